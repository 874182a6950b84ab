"""Load a local Hugging Face checkpoint directory, offline, through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import HypicError, UnsupportedArchitectureError


def load_local(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a directory holding config.json, safetensors weights and tokenizer files.

    Never downloads. The architecture is checked before weights are read, so an unsupported
    model fails fast with the reason.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .adapters import ADAPTERS
    from .adapters import _NOT_RESUMABLE

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HypicError(f"{path}: not a model directory (config.json missing)")
    model_type = json.loads(cfg_file.read_text()).get("model_type", "<missing>")
    known = {t for cls in ADAPTERS for t in cls.model_types}
    if model_type not in known:
        reason = _NOT_RESUMABLE.get(model_type, "no adapter knows how to cache its layers")
        raise UnsupportedArchitectureError(f"model type {model_type!r} is not supported: {reason}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer
