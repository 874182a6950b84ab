"""Token selection: greedy or sampled (temperature, top-k, top-p, min-p), with log-probabilities,
repetition penalty and banned tokens (vLLM semantics)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingParams


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float  # log-probability under the model's (unprocessed) distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Picks the next token from fp32 logits. Seeded sampling is reproducible.

    The logits are processed in vLLM's order: repetition penalty, banned tokens, then (sampling
    only) temperature, top-k, top-p and min-p; greedy decoding takes the argmax of the penalised,
    unbanned logits. The reported `logprob` and `top_logprobs` are those of the model's
    unprocessed distribution. With every extra at its default (no history penalty, nothing
    banned, min_p 0) the choice is bit-identical to plain temperature / top-k / top-p sampling.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = (), banned: Collection[int] = (),
                 draft: int | None = None) -> Choice:
        """Choose one token from `logits` (1-D, one entry per vocabulary id).

        `history`: the prompt's token ids followed by the ids generated so far (a sequence of ints
        or a 1-D integer tensor); with `repetition_penalty != 1` every distinct id in it is
        penalised once: a positive logit is divided by the penalty, a negative one multiplied.
        `banned`: ids that must not be chosen at this step (their logits become -inf). The engine,
        not the sampler, owns the policy: it passes its EOS ids while fewer than `min_tokens`
        tokens have been generated, and on every step when `ignore_eos` is set. Ids outside the
        vocabulary are ignored in both. Raises ValueError when every token is banned.

        `draft` (speculative decoding): a token proposed for this position by a deterministic
        drafter. Greedy decoding ignores it (the caller compares). Sampling keeps it with the
        probability the final distribution p gives it, else samples from p without it,
        renormalised: the standard rejection rule for a one-token proposal, so the tokens chosen
        follow p exactly, draft or not.
        """
        logits = logits.float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        token = self._pick(self._process(logits, history, banned), draft)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.top_logprobs:
            vals, idx = logprobs.topk(self.params.top_logprobs)
            top = tuple(zip(idx.tolist(), vals.tolist()))
        return Choice(token, float(logprobs[token]), top)

    def _process(self, logits: torch.Tensor, history: Sequence[int], banned: Collection[int]) -> torch.Tensor:
        """Repetition penalty then banned tokens; out of place (the caller's tensor is never written)."""
        vocab = logits.numel()
        penalty = self.params.repetition_penalty
        if penalty != 1.0 and len(history):
            ids = _ids(history, vocab)
            if ids.numel():
                seen = logits[ids]
                big = torch.finfo(logits.dtype).max  # a tiny penalty must not turn a logit into inf
                logits = logits.index_put((ids,), torch.where(seen > 0, seen / penalty, seen * penalty).clamp(-big, big))
        if len(banned):
            ids = _ids(banned, vocab)
            if ids.numel():
                logits = logits.index_fill(0, ids, float("-inf"))
                if bool(torch.isneginf(logits).all()):
                    raise ValueError("every token is banned; nothing can be chosen")
        return logits

    def _pick(self, logits: torch.Tensor, draft: int | None = None) -> int:
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        scaled = logits / p.temperature
        if bool(torch.isposinf(scaled).any() or torch.isnan(scaled).any()):
            # A temperature so small the division overflows: its limit, every weight on the best token(s).
            scaled = torch.where(logits == logits.max(), 0.0, float("-inf"))
        logits = scaled
        if p.top_k and p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # smallest set whose mass reaches top_p
            keep[0] = True  # the most likely token always (a top_p below float precision keeps nothing else)
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        if p.min_p > 0.0:  # relative to the most likely token, which top-k / top-p always keep
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if draft is not None and 0 <= draft < probs.numel():
            if float(torch.rand((), generator=self.generator)) < float(probs[draft]):
                return draft
            rest = probs.clone()
            rest[draft] = 0.0
            if float(rest.sum()) <= 0.0:
                return draft
            probs = rest / rest.sum()
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _ids(tokens: Sequence[int] | Collection[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    """The distinct ids of `tokens` inside [0, vocab), as a long tensor."""
    if isinstance(tokens, torch.Tensor):
        ids = tokens.reshape(-1).to(device="cpu", dtype=torch.long)
    else:
        ids = torch.as_tensor(tokens if isinstance(tokens, Sequence) else list(tokens), dtype=torch.long)
    ids = torch.unique(ids)
    return ids[(ids >= 0) & (ids < vocab)]
