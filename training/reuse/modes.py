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
        composed. The question and the reply run in the stitch's own forward (`stitch(keep=...)`),
        as one question would: a second forward on the stitched cache would update its linear
        states in place, which autograd cannot go back through. Raises ValueError for a layout
        without context or an empty reply."""
        *context, question = layout.segments
        if not context or not question or not reply:
            raise ValueError("a composed sample needs context segments, a question and a reply")
        request = GenerationRequest(tuple(layout.segments), mode=Mode.HYPIC, seam=self.seam, exact_prefix=layout.exact_prefix)
        exact = leading_exact(request, self.config)
        runner = self.runner
        tail = tuple(question) + tuple(reply)[:-1]
        with torch.enable_grad():
            # the exact prefix is stitched with a seam covering it (computed in context from position 0:
            # the same K/V and states as its exact forward) rather than run first on the cache, so
            # the stitch starts from its own zero state, not from a cache tensor it updates in place
            lead = tuple(tuple(s) for s in context[:exact])
            rest = tuple(tuple(s) for s in context[exact:])
            entries = (runner.compute_entries_reference(lead, max(map(len, lead)), keep_graph=True) if lead else []) + \
                (runner.compute_entries_reference(rest, self.seam, keep_graph=True) if rest else [])
            return runner.stitch(runner.new_cache(), lead + rest, entries, tail, True, keep=len(reply))
