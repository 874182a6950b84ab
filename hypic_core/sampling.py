"""Token selection: greedy or sampled (temperature, top-k, top-p), with log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float  # log-probability under the model's (unprocessed) distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Picks the next token from fp32 logits. Seeded sampling is reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> Choice:
        logits = logits.float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        token = self._pick(logits)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.top_logprobs:
            vals, idx = logprobs.topk(self.params.top_logprobs)
            top = tuple(zip(idx.tolist(), vals.tolist()))
        return Choice(token, float(logprobs[token]), top)

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # smallest set whose mass reaches top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.generator))
