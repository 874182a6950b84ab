"""One model replica that computes canonical entries for a prefill pool, in its own process.

A replica loads the engine's checkpoint from its path, so every replica (and the engine)
holds the same weights; `weights` (a digest of them) lets the pool check that before it
trusts a replica. An entry leaves the replica as the bytes `cache.serde.encode` writes, which
carry their own checksum: the requester decodes them exactly as it decodes a disk-tier hit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..algebra.keys import SegmentKey, model_fingerprint


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads: a local checkpoint directory, in `dtype` on `device`, using `threads`
    torch intra-op threads. `threads` None: the machine's cores split evenly between `workers`."""

    path: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    threads: int | None = None

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"prefill workers load a checkpoint directory; {self.path!r} has no config.json")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def threads_for(self, workers: int) -> int:
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // max(1, workers))


@dataclass(frozen=True)
class Task:
    """One segment to compute, stored under `key` (the requester's key: the bytes name it)."""

    id: int
    segment: tuple[int, ...]
    seam: int
    key: SegmentKey


def weights_digest(model: torch.nn.Module) -> str:
    """What the pool compares between the engine's model and a replica's (no tokenizer involved)."""
    return model_fingerprint(model, "prefill-replica")


class Replica:
    """A loaded model and its runner. `compute` is what a worker does with each task."""

    def __init__(self, spec: ReplicaSpec, threads: int):
        from transformers import AutoModelForCausalLM

        from ..adapters import adapter_for
        from ..runner.model_runner import ModelRunner

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=spec.dtype, local_files_only=True,
                                                     use_safetensors=True)
        model = model.to(spec.device).eval()
        self.runner = ModelRunner(model, adapter_for(model))
        self.weights = weights_digest(model)

    def compute(self, task: Task) -> bytes:
        """The serialized canonical entry of `task.segment`: the bytes of `compute_entries([segment])`
        on the engine's own runner (one segment per call, so grouping never changes a bit)."""
        from ..cache.serde import encode

        with torch.inference_mode():
            entry = self.runner.compute_entries([task.segment], task.seam, max(1, len(task.segment)))[0]
        return encode(entry, task.key)
