"""The teacher of the hybrid's distillation, SmolLM2-135M-Instruct: where it is and how it is loaded.

Its own module so that every training script (distill, generate, sensitivity, restore,
retrieval_heads) loads the teacher the same way without importing one another.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEACHER = "smollm2-135m-instruct"


def teacher_dir() -> Path:
    """The teacher's local checkpoint directory (converted from its GGUF on first use)."""
    from hypic_core.models.registry import resolve

    return resolve(TEACHER).path


def load_teacher():
    """(directory, model, tokenizer): the teacher in fp32, in eval mode, every parameter frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = teacher_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return path, model, AutoTokenizer.from_pretrained(path)
