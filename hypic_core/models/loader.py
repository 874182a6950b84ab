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


# A reuse adapter (training/reuse, `hypic tune`): LoRA factors per adapted linear, scale folded into
# `up`, so the merged weight is `W + up @ down`, or (full fine-tuning, `--method full`) a delta per
# parameter, `<parameter>.delta`, added to it; trained link tokens (`--link`) as the change of a few
# rows of the input embedding, `<parameter>.row_delta` added to the rows `<parameter>.row_ids`; and a
# JSON card naming the base model and the run (and the link text, which the merged model is served with).
ADAPTER_FILE = "adapter.safetensors"
DELTA = ".delta"
ROW_DELTA = ".row_delta"
ROW_IDS = ".row_ids"
ADAPTER_CARD = "adapter.json"


def adapter_card(adapter_dir: str | Path) -> dict:
    """The adapter directory's card. Raises HypicError when it is not an adapter directory."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_FILE).is_file() or not (adapter_dir / ADAPTER_CARD).is_file():
        raise HypicError(f"{adapter_dir}: not a reuse adapter ({ADAPTER_FILE} and {ADAPTER_CARD} expected)")
    return json.loads((adapter_dir / ADAPTER_CARD).read_text())


def merge_adapter(weights: dict[str, torch.Tensor], factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a checkpoint's state dict) with every adapter factor pair merged into its
    linear's weight (`<linear>.weight += lora_up @ lora_down`, in fp32, then the weight's dtype) and
    every delta of a fully fine-tuned adapter added to its parameter (`<parameter> += <parameter>.delta`),
    and trained rows added to theirs (`<parameter>[row_ids] += row_delta`). Raises HypicError for a
    factor naming a weight the checkpoint lacks or of another shape."""
    out = dict(weights)
    for key in sorted(k for k in factors if k.endswith(ROW_DELTA)):  # link tokens: rows of the input embedding
        name, rows = key[: -len(ROW_DELTA)], factors[key]
        ids = factors.get(f"{name}{ROW_IDS}")
        if name not in out:
            raise HypicError(f"adapter: the checkpoint has no {name}; the adapter was trained for another model")
        w = out[name]
        if ids is None or ids.dim() != 1 or rows.dim() != 2 or len(ids) != rows.shape[0] or rows.shape[1] != w.shape[1]:
            raise HypicError(f"adapter: {name} is {tuple(w.shape)}, the adapter's rows {tuple(rows.shape)} for "
                             f"{None if ids is None else tuple(ids.shape)} ids")
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < w.shape[0]):
            raise HypicError(f"adapter: {name} has {w.shape[0]} rows, the adapter names row {int(ids.max())}")
        w = w.clone()
        w[ids.long()] = (w[ids.long()].float() + rows.float()).to(w.dtype)
        out[name] = w
    for key in sorted(k for k in factors if k.endswith(DELTA)):  # full fine-tuning: the parameter's change
        name, delta = key[: -len(DELTA)], factors[key]
        if name not in out:
            raise HypicError(f"adapter: the checkpoint has no {name}; the adapter was trained for another model")
        if tuple(delta.shape) != tuple(out[name].shape):
            raise HypicError(f"adapter: {name} is {tuple(out[name].shape)}, the adapter's delta {tuple(delta.shape)}")
        out[name] = (out[name].float() + delta.float()).to(out[name].dtype)
    names = sorted({k.rsplit(".", 1)[0] for k in factors if not k.endswith((DELTA, ROW_DELTA, ROW_IDS))})
    for name in names:
        down, up = factors.get(f"{name}.lora_down"), factors.get(f"{name}.lora_up")
        key = f"{name}.weight"
        if down is None or up is None:
            raise HypicError(f"adapter: {name} has one factor of two")
        if key not in out:
            raise HypicError(f"adapter: the checkpoint has no {key}; the adapter was trained for another model")
        w = out[key]
        if (up.shape[0], down.shape[1]) != tuple(w.shape):
            raise HypicError(f"adapter: {key} is {tuple(w.shape)}, the adapter's correction {(up.shape[0], down.shape[1])}")
        out[key] = (w.float() + up.float() @ down.float()).to(w.dtype)
    return out


def write_adapted(checkpoint: str | Path, adapter_dir: str | Path, target: str | Path, stamp: dict | None = None) -> Path:
    """Write `checkpoint` with the adapter in `adapter_dir` merged into `target` (config, tokenizer
    and other files copied, weights merged; atomic: built beside `target`, then renamed)."""
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint, target = Path(checkpoint), Path(target)
    adapter_card(adapter_dir)
    factors = load_file(str(Path(adapter_dir) / ADAPTER_FILE))
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json", "*.lock"))
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(f))
    if not weights:
        raise HypicError(f"{checkpoint}: no safetensors weights to merge an adapter into")
    save_file({k: v.contiguous() for k, v in merge_adapter(weights, factors).items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if stamp is not None:
        (tmp / "hypic-model.json").write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
