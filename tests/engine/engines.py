"""The engine tests' one fixture factory: `engine(seam=..., family=..., **config)` builds an `Engine`
on a tiny random model (one model per family, shared), and `FakePool`, a prefill pool that computes
entries with the engine's own runner but hands them out only when asked to wait or poll."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: conftest's helpers

from conftest import random_segments  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import tiny_model  # noqa: E402

__all__ = ["FakePool", "engine", "model", "random_segments", "request"]


@functools.cache
def model(family: str = "qwen3_5"):
    return tiny_model(family)


def engine(seam: int = 4, family: str = "qwen3_5", prefill_pool=None, **config) -> Engine:
    """A fresh engine (its own store) on the shared tiny model of `family`."""
    return Engine(model(family), config=EngineConfig(seam=seam, **config), prefill_pool=prefill_pool)


def request(segments, mode: str = "hypic", max_tokens: int = 1, **kw) -> GenerationRequest:
    return GenerationRequest(tuple(segments), mode=mode, sampling=SamplingParams(max_tokens=max_tokens),
                             keep_logits=True, **kw)


class FakePool:
    """A prefill pool in this process: `submit` only records the work; `wait_any` computes the first
    pending one (with the bound runner), `poll` computes nothing. Every call is logged in `calls`."""

    split_tokens = 0
    alive = 1

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pending: dict[int, tuple[tuple[int, ...], int]] = {}
        self.done: dict[int, object] = {}
        self.runner = None

    def bind(self, fingerprint: str, runner) -> str:
        self.runner = runner
        return fingerprint

    def submit(self, work):
        self.calls.append("submit")
        tickets = []
        for segment, seam in work:
            ticket = len(self.pending) + len(self.done) + 1
            self.pending[ticket] = (tuple(segment), seam)
            tickets.append(ticket)
        return tickets

    def poll(self) -> None:
        self.calls.append("poll")

    def wait_any(self, tickets) -> None:
        self.calls.append("wait")
        ticket = next(t for t in tickets if t in self.pending)
        segment, seam = self.pending.pop(ticket)
        self.done[ticket] = self.runner.compute_entries([segment], seam, 0)[0]

    def take(self, ticket):
        return self.done.pop(ticket, None)

    def cancel(self, ticket) -> None:
        self.pending.pop(ticket, None)

    def compute_entries(self, segments, seam, max_batch_tokens=0):
        return self.runner.compute_entries(list(segments), seam, max_batch_tokens)

    def close(self) -> None:
        pass
