"""Output processing: a sequence's next-token logits in, its `StepOutput` out.

Sampling (`Sampler`: temperature, top-k/p, min-p, repetition penalty, EOS banned until
`min_tokens`), incremental detokenization (`detokenizer_for`: `tokenizers`' `DecodeStream`), and
the stop conditions (EOS, a stop string, `max_tokens` or the end of the context), and the cursors:
`move_cursors` is the one place `Sequence.num_computed_tokens` is written, from what the executor
reported (data flows one way: scheduler output -> model output -> update). It touches no model,
cache or queue: the engine releases a sequence whose output has a `finish_reason`.
"""

from __future__ import annotations

import torch

from typing import Callable

from ..config import SamplingParams
from .detokenizer import detokenizer_for
from .sampling import Sampler
from .sequence import Sequence, StepOutput


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def sampler(self, params: SamplingParams) -> Sampler:
        return Sampler(params)

    def detokenizer(self, stop: tuple[str, ...]):
        return detokenizer_for(self.tokenizer, stop)

    def next_token(self, seq: Sequence, logits: torch.Tensor, draft: int | None = None) -> StepOutput:
        """Pick `seq`'s next token (appended to `seq.output_ids`) and decide whether it ends here. `draft`:
        the token speculation fed after this position (the sampler's rejection rule keeps it or not)."""
        params = seq.request.sampling
        history = seq.history if params.repetition_penalty != 1.0 else ()
        choice = seq.sampler(logits, history, seq.banned_tokens(), draft=draft)
        index = seq.num_generated
        seq.output_ids.append(choice.token_id)
        detok = seq.detokenizer
        finish, text = None, ""
        if choice.token_id in seq.eos_ids and not params.ignore_eos:
            finish, text = "stop", detok.flush()
        else:
            text = detok.push(choice.token_id)
            if detok.stopped:
                finish = "stop"
            elif seq.num_generated >= seq.max_new_tokens:
                finish, text = "length", text + detok.flush()
        first = index == 0
        return StepOutput(seq.request_id, index, choice.token_id, text, choice.logprob, choice.top_logprobs, finish,
                          seq.stats if first else None, logits=logits if first and seq.request.keep_logits else None)

    def update(self, scheduled, executed, speculator,
               release: Callable[[Sequence, StepOutput], None]) -> tuple[list[StepOutput], dict[Sequence, int]]:
        """The step's update: move every cursor by what the step advanced (`move_cursors`), sample every
        sequence the step left logits for (a verified row: the tokens it keeps, `Speculator.accept`, its
        rejected draft rolled back), end the aborted and the failed ones. `release(seq, out)` is called for
        every output (the engine delivers it, and releases a sequence it ends). Returns the outputs and the
        tokens each verified row kept (the executor keeps their state, `Executor.leave`)."""

        def emit(seq: Sequence, out: StepOutput) -> StepOutput:
            release(seq, out)
            return out

        outputs = [emit(seq, self.ended(seq, "abort")) for seq in scheduled.aborted]
        outputs += [emit(seq, self.ended(seq, "error", exc)) for seq, exc in executed.errors.items()]
        kept: dict[Sequence, int] = {}
        for seq, logits in executed.logits.items():
            if seq in executed.drafts:  # a row of the verification forward: logits after each token it was fed
                outs = speculator.accept(seq, logits, executed.drafts[seq], lambda t, guess, seq=seq, logits=logits:
                                         emit(seq, self.next_token(seq, logits[t], draft=guess)))
                kept[seq] = len(outs)
                outputs += outs
            else:
                outputs.append(emit(seq, self.next_token(seq, logits)))
        move_cursors(executed, kept)
        return outputs, kept

    def ended(self, seq: Sequence, reason: str, error: BaseException | None = None) -> StepOutput:
        """`seq`'s last output when it ends without a new token ("abort" or "error")."""
        return StepOutput(seq.request_id, seq.num_generated, None, seq.detokenizer.flush(), finish_reason=reason,
                          stats=seq.stats if seq.num_generated == 0 else None, error=error)


def move_cursors(executed, kept: dict[Sequence, int]) -> None:
    """The only place a cursor moves: each sequence by the tokens the step advanced its cache
    (`Executed.advanced`); a verified row (`kept`: tokens it emitted) then gives back the draft tokens it
    rejected (fed 1 + its draft, kept `kept`), as vLLM's `num_computed_tokens -= num_rejected`."""
    for seq, tokens in executed.advanced.items():
        seq.num_computed_tokens += tokens
    for seq, k in kept.items():
        seq.num_computed_tokens -= 1 + len(executed.drafts[seq]) - k


def eos_ids(model, tokenizer) -> frozenset[int]:
    """The token ids that end a sequence: the model's generation config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
