"""Speculative decoding in the decode step: who drafts, the verification forward, what each row keeps.

`Speculator.drafts` proposes prompt-lookup drafts (hypic_core/engine/drafting.py) for the rows of
the decode batch that speculate, priced by what a draft token costs at this batch size now
(`DraftCost`); `verify` runs them as ONE verification forward (hypic_core/runner/verify_step.py);
`accept` turns a row's logits into the tokens it emits; `commit` keeps, per row, the tokens it
emitted from and rolls back the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import EngineConfig
from ..runner.verify_step import Verified, VerifyStep
from .drafting import DraftBudget, DraftCost, PromptLookup
from .sequence import Sequence, StepOutput


@dataclass
class SpeculationStats:
    """Counters of speculative decoding since start (the gateway exports them)."""

    drafted: int = 0  # draft tokens fed to verification forwards
    accepted: int = 0  # of them, the tokens the model agreed with (emitted without a step of their own)
    verify_steps: int = 0  # decode steps that ran as a verification forward


class Speculator:
    def __init__(self, config: EngineConfig, max_positions: int):
        self.config, self.max_positions = config, max_positions
        self.stats = SpeculationStats()
        self.cost = DraftCost(config.speculation_cost)
        self._verify: VerifyStep | None = None  # built on the first draft (speculation needs the lean decode step)

    def speculates(self, seq: Sequence) -> bool:
        wanted = seq.request.speculation
        return self.config.speculation if wanted is None else wanted

    def drafts(self, batch, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Drafts of the sequences that speculate; {} when none drafts or `batch`'s decode step cannot
        verify (the lean step's families only)."""
        if not any(self.speculates(s) for s in seqs):
            return {}
        if self._verify is None or self._verify.lean is not batch.step:
            self._verify = VerifyStep.build(batch)
        if self._verify is None or not self.cost.ready(len(seqs)) or not self.cost.pays(len(seqs)):
            return {}  # no plain step of this size timed yet, or verification has not paid at this size lately
        # A plain step of B rows yields B tokens; one row's draft token makes the whole step dearer by the
        # measured price, i.e. by B tokens' worth of that row's share.
        price = self.cost.cost(len(seqs)) * len(seqs)
        drafts: dict[Sequence, list[int]] = {}
        for s in seqs:
            if not self.speculates(s):
                continue
            if s.drafter is None:
                s.drafter = PromptLookup([t for seg in s.request.segments for t in seg], self.config.speculation_ngram,
                                         self.config.speculation_min_ngram)
                s.draft_budget = DraftBudget(self.config.speculation_max_draft)
            s.draft_budget.cost = price  # what a drafted token costs at this batch size on this machine now
            k = min(s.draft_budget.next_k(), s.max_new_tokens - s.num_generated - 1, self.max_positions - s.num_computed_tokens - 2)
            if k <= 0:
                continue
            s.drafter.extend(s.output_ids[len(s.drafter.tokens) - s.request.prompt_tokens:])
            draft = s.drafter.propose(k)
            if draft:
                drafts[s] = draft
                self.stats.drafted += len(draft)
        return drafts

    def verify(self, batch, drafts: dict[Sequence, list[int]]) -> tuple[Verified, dict[Sequence, torch.Tensor], float]:
        """One verification forward: each row its last token and its draft. Returns the result, each
        row's logits after every token it was fed ([n, vocab]) and the forward's seconds."""
        t0 = time.perf_counter()
        fed = [[s.output_ids[-1], *drafts.get(s, ())] for s in batch.keys]
        verified = self._verify.verify(batch, fed, [s.num_computed_tokens for s in batch.keys])
        seconds = time.perf_counter() - t0
        self.cost.verify(len(fed), sum(map(len, drafts.values())), seconds)
        self.stats.verify_steps += 1
        return verified, {s: verified.logits[r, :len(fed[r])] for r, s in enumerate(batch.keys)}, seconds

    def accept(self, seq: Sequence, logits: torch.Tensor, draft: list[int],
               emit: Callable[[int, int | None], StepOutput]) -> list[StepOutput]:
        """Tokens from a verification's logits [n, vocab] (`emit(t, guess)` samples from row t): the token
        after each fed token, while the one chosen equals the draft token fed next (greedy: the argmax;
        sampling: the speculative rejection rule, `Sampler`), and the first that does not; none after
        the sequence ends."""
        outs: list[StepOutput] = []
        for t in range(logits.shape[0]):
            guess = draft[t] if t < len(draft) else None
            out = emit(t, guess)
            outs.append(out)
            if out.finish_reason is not None or guess is None or out.token_id != guess:
                break
        if draft:
            accepted = sum(1 for t, o in enumerate(outs) if t < len(draft) and o.token_id == draft[t])
            seq.draft_budget.record(len(draft), accepted)
            self.stats.accepted += accepted
        return outs

    def commit(self, batch, verified: Verified, kept: dict[Sequence, int], seconds: float) -> None:
        """Each row's state keeps the tokens it emitted from (`kept`, 1 for a row that emitted none) and rolls
        back the rest (its cursor was rolled back beside its advance, in the update: output.py `move_cursors`)."""
        VerifyStep.commit(batch, verified, [kept.get(s, 1) for s in batch.keys])
        self.cost.verified(len(batch.keys), sum(kept.values()), seconds)
