"""Export a training checkpoint as a standard Hugging Face model directory.

Writes config.json, model.safetensors (bfloat16 by default, to keep the repository small),
generation_config.json and the tokenizer files (the tokenizer saved by the training run
beside the checkpoint, in ``tokenizer/``). The model loads with
``AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)``.

Usage: ``python -m training.export var/train/best.pt models/hypic-tiny``
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig


def export(checkpoint: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Save the checkpoint's model + tokenizer to ``out_dir``; returns step and parameter count."""
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    config = Qwen3_5TextConfig.from_dict(state["config"])
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(config)
    model.load_state_dict(state["model"])
    model.to(dtype)
    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(checkpoint), "tokenizer"))
    model.generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"step": state["step"], "params": sum(p.numel() for p in model.parameters()),
            "curriculum": state["curriculum"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="checkpoint -> Hugging Face model directory")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--fp32", action="store_true", help="store float32 weights instead of bfloat16")
    args = p.parse_args(argv)
    info = export(args.checkpoint, args.out_dir, torch.float32 if args.fp32 else torch.bfloat16)
    print(f"exported step {info['step']} ({info['params']} parameters) to {args.out_dir}")


if __name__ == "__main__":
    main()
