"""The engine tests' one fixture factory: `engine(seam=..., family=..., **config)` builds an `Engine`
on a tiny random model (one model per family and overrides, shared), and `FakePool`, a prefill pool
that computes entries with the engine's own runner but hands them out only when asked to wait or poll.

    engine(3, "bamba", max_step_tokens=16)  # the shared bamba model, EngineConfig(seam=3, max_step_tokens=16)
    engine(4, tokenizer=tok)                # the shared qwen3_5 model sized to tok's vocabulary
    engine(like=other, max_step_tokens=16)  # other's model, tokenizer, id and settings; a fresh store
    engine(model=tiny_model("qwen3_5"))     # a model of the test's own, for a test that changes it
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: conftest's helpers

from conftest import random_segments  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import tiny_model  # noqa: E402

__all__ = ["FakePool", "engine", "model", "random_segments", "request"]

SEAM = 4  # the factory's seam when neither the call nor `like` names one


@functools.cache
def model(family: str = "qwen3_5", **overrides):
    """The shared tiny model of `family`, one per set of `tiny_model` overrides (vocab_size,
    max_position_embeddings, ...). A test that changes its model, or runs a lean decode step on it,
    builds its own with `tiny_model`."""
    return tiny_model(family, **overrides)


def engine(seam: int | None = None, family: str = "qwen3_5", *, model=None, tokenizer=None, like: Engine | None = None,
           store=None, model_id: str | None = None, prefill_pool=None, **config) -> Engine:
    """A fresh engine (its own store unless `store` is given).

    The tokenizer and model id are `tokenizer`, `model_id`, else `like`'s, else none and "model". The
    model is `model`, else `like`'s, else the shared tiny model of `family` (with a tokenizer, sized to
    its vocabulary), or a new one when `decode_step` is not "module" (the lean step makes a model's
    weights views of fused copies: on the shared model that would change what every later test runs).
    The settings are `EngineConfig(seam=seam, **config)` (seam 4 when not given), or with `like` its
    settings, `seam` and `config` replacing fields."""
    if like is not None:
        model = like.model if model is None else model
        tokenizer = like.tokenizer if tokenizer is None else tokenizer
        model_id = like.model_id if model_id is None else model_id
        settings = dataclasses.replace(like.config, **({} if seam is None else {"seam": seam}), **config)
    else:
        settings = EngineConfig(seam=SEAM if seam is None else seam, **config)
    if model is None:
        sizes = {} if tokenizer is None else {"vocab_size": len(tokenizer)}
        model = (_shared if settings.decode_step == "module" else tiny_model)(family, **sizes)
    return Engine(model, tokenizer, settings, store, model_id or "model", prefill_pool=prefill_pool)


_shared = model  # `engine`'s parameter `model` hides the function there


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
