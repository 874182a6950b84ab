"""Load a local Hugging Face checkpoint directory, offline, through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import HypicError, UnsupportedArchitectureError


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str | torch.dtype, device: str, config: dict) -> torch.dtype:
    """`dtype` as a torch dtype; "auto" is float32 on CPU and, on an accelerator, the checkpoint's
    half-precision dtype (bfloat16 when the checkpoint is float32 or says nothing)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise HypicError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if device == "cpu":
        return torch.float32
    stored = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


def load_local(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) from a directory holding config.json, safetensors weights and tokenizer
    files, in `dtype` (see `pick_dtype`) on `device`.

    Never downloads. The architecture is checked before weights are read, so an unsupported
    model fails fast with the reason.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..adapters import ADAPTERS
    from ..adapters import _NOT_RESUMABLE

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HypicError(f"{path}: not a model directory (config.json missing)")
    config = json.loads(cfg_file.read_text())
    model_type = config.get("model_type", "<missing>")
    known = {t for cls in ADAPTERS for t in cls.model_types}
    if model_type not in known:
        reason = _NOT_RESUMABLE.get(model_type, "no adapter knows how to cache its layers")
        raise UnsupportedArchitectureError(f"model type {model_type!r} is not supported: {reason}")
    dtype = pick_dtype(dtype, device.split(":")[0], config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(device).eval(), tokenizer
