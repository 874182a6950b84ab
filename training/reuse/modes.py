"""The answer span's logits of one sample in `full` and in composed (`hypic`) mode, with autograd.

`full`: one forward over the prompt and the reply. Composed: the prompt as the engine serves a
warm `hypic` request, by the engine's own runner (hypic_core/runner/model_runner.py): the leading
segments it computes exactly (`leading_exact`, the engine's rule) run in context; every other
context segment's canonical entry is computed alone (`compute_entries_reference(keep_graph=True)`,
after the engine's `entry_prefix`), and `stitch` rotates their keys, recomputes each seam head in
context and composes the linear states; then the question and the reply run on that cache. The
graph is kept throughout, so a loss on the reply trains both what each document writes into its
cache entry and how the answer reads it.

With a seam at least as long as every segment, composed equals `full` (the engine's exactness
invariant; tests/training/test_reuse_training.py checks it through this module).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hypic_core.adapters import adapter_for
from hypic_core.config import EngineConfig, GenerationRequest, Mode
from hypic_core.engine.plan import leading_exact
from hypic_core.runner.model_runner import ModelRunner

from .data import Layout


def answer_start(layout: Layout) -> int:
    """The position whose logits predict the reply's first token (the prompt's last)."""
    return len(layout.ids) - 1


def full_logits(model, layout: Layout, reply: Sequence[int]) -> torch.Tensor:
    """[len(reply), vocab]: the logits predicting each reply token, one forward over prompt + reply."""
    ids = torch.tensor([layout.ids + list(reply)[:-1]], dtype=torch.long, device=model.device)
    return model(input_ids=ids, use_cache=False, logits_to_keep=len(reply)).logits[0]


class Composer:
    """Composed-mode logits for one model, as the engine's runner stitches them at `seam`."""

    def __init__(self, model, seam: int = 8, entry_prefix: Sequence[int] = ()) -> None:
        if seam < 0:
            raise ValueError(f"seam must be >= 0, got {seam}")
        self.model = model
        self.seam = seam
        self.config = EngineConfig(seam=seam, entry_prefix=tuple(entry_prefix))
        self.runner = ModelRunner(model, adapter_for(model), entry_prefix=self.config.entry_prefix)

    def logits(self, layout: Layout, reply: Sequence[int]) -> torch.Tensor:
        """[len(reply), vocab]: the logits predicting each reply token, the prompt's context
        composed. The stitch runs the whole question, as the engine's prefill does, and the reply
        runs on its cache; no forward is a single token (a model's one-token path updates its
        linear states in place, which autograd cannot go back through): with a two-token reply the
        question's last token runs with the reply. Raises ValueError for a layout without context,
        a question under 3 tokens, or an empty reply."""
        *context, question = layout.segments
        if not context or len(question) < 3 or not reply:
            raise ValueError("a composed sample needs context segments, a question of >= 3 tokens and a reply")
        request = GenerationRequest(tuple(layout.segments), mode=Mode.HYPIC, seam=self.seam, exact_prefix=layout.exact_prefix)
        exact = leading_exact(request, self.config)
        runner, device = self.runner, self.model.device
        tail = list(question) + list(reply)[:-1]
        split = len(question) - 1 if len(reply) == 2 else len(question)
        with torch.enable_grad():
            # the exact prefix is stitched with a seam covering it (computed in context from position 0:
            # the same K/V and states as its exact forward) instead of run first on the cache: the
            # stitch then starts from its own zero state, never from a cache tensor that later
            # forwards update in place under autograd
            lead = tuple(tuple(s) for s in context[:exact])
            rest_ctx = tuple(tuple(s) for s in context[exact:])
            entries = (runner.compute_entries_reference(lead, max(map(len, lead)), keep_graph=True) if lead else []) + \
                (runner.compute_entries_reference(rest_ctx, self.seam, keep_graph=True) if rest_ctx else [])
            cache = runner.new_cache()
            first = runner.stitch(cache, lead + rest_ctx, entries, tuple(tail[:split]), True)
            parts = [first[None]] if split == len(question) else []
            if split < len(tail):
                at = len(layout.ids) - len(question) + split
                ids = torch.tensor([tail[split:]], dtype=torch.long, device=device)
                pos = torch.arange(at, at + len(tail) - split, device=device)[None]
                parts.append(self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits[0])
        out = torch.cat([p.float() for p in parts])
        assert out.shape[0] == len(reply), (out.shape, len(reply))
        return out
