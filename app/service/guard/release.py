"""A model's release faithfulness, from its model card: `faithfulness.json` beside the checkpoint, or in
the repository's models/<name>/ (the named models whose checkpoints are assembled elsewhere).

The file is what bench/faithfulness.py measured for the model as shipped (its default reuse configuration
against `full`, greedy, `answer_tokens` tokens, on the held-out faithfulness prompts):

    {"model": "smollm2-hybrid-135m", "config": "hypic:8", "answer_tokens": 32, "n": 400,
     "identical": 0.21, "low": 0.17, "high": 0.25, "command": "...", "measured": "2026-12-07", "cpu": "..."}
"""

from __future__ import annotations

import json
from pathlib import Path

from .policy import Release

ROOT = Path(__file__).resolve().parents[3]
FILE = "faithfulness.json"


def card_paths(name: str, checkpoint: Path | str | None = None) -> list[Path]:
    """Where a model's release measurement may be, in the order looked at."""
    paths = [Path(checkpoint) / FILE] if checkpoint is not None else []
    if name and "/" not in name and name not in (".", ".."):
        paths.append(ROOT / "models" / name / FILE)
    return paths


def load_release(path: Path | str) -> Release:
    """The release measurement in `path`. Raises ValueError naming the file and the field that is missing or
    out of range."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON model-card measurement ({exc})") from exc
    for field in ("identical", "low", "high"):
        value = data.get(field)
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{path}: field {field!r} must be a number in [0, 1], got {value!r}")
    if not data["low"] <= data["identical"] <= data["high"]:
        raise ValueError(f"{path}: fields 'low' <= 'identical' <= 'high' do not hold ({data['low']}, {data['identical']}, {data['high']})")
    for field in ("n", "answer_tokens"):
        if not isinstance(data.get(field), int) or data[field] < 1:
            raise ValueError(f"{path}: field {field!r} must be an integer >= 1, got {data.get(field)!r}")
    if not isinstance(data.get("config"), str):
        raise ValueError(f"{path}: field 'config' must name the configuration measured (e.g. 'hypic:8'), got {data.get('config')!r}")
    return Release(float(data["identical"]), float(data["low"]), float(data["high"]), data["n"], data["answer_tokens"],
                   data["config"], str(path))


def release_for(name: str, checkpoint: Path | str | None = None) -> Release | None:
    """The model card's release measurement of model `name` (checkpoint directory `checkpoint`), None when it
    has none. Raises ValueError for a card that is there but malformed."""
    for path in card_paths(name, checkpoint):
        if path.is_file():
            return load_release(path)
    return None
