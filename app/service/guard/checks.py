"""Shadow checks: a served request's segments run again in `full` and in each approximate configuration
under watch, greedy, through the engine's step loop (no second model path), and compared.

A check compares the first-token distributions (KL(full || served), top-1 agreement) and, when it is an
answer check, the first `answer_tokens` greedy tokens (to the first EOS, inclusive): the whole answer a
client would read, not its first token alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypic_core.config import GenerationRequest, Mode, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.engine.sequence import StepOutput

from .policy import CheckResult, Choice

CHECK_PRIORITY = 1 << 20  # after every served request (priority 0) when the engine schedules by priority


@dataclass(frozen=True)
class ShadowCheck:
    """A request queued for checking: its segments and the approximate configurations to compare."""

    segments: tuple[tuple[int, ...], ...]
    choices: tuple[Choice, ...]
    greedy: bool  # an answer check: compares the first `answer_tokens` greedy tokens too
    exact_prefix: int = 0  # leading segments the served request reused exactly (checked as served)
    cache_salt: str = ""  # the served request's (its tenant's): a check's entries are that tenant's


def check_requests(check: ShadowCheck, answer_tokens: int) -> list[GenerationRequest]:
    """A check as requests: `full` first, then one per configuration in `check.choices`; greedy, the
    first-token logits kept, `answer_tokens` tokens (to the first EOS, inclusive) when the check
    compares answers. exact_runs=False: the check judges composition, so a run the served request may
    have reused exactly (a repeat) is composed here, and the check records no sighting of it."""
    sampling = SamplingParams(max_tokens=answer_tokens if check.greedy else 1)
    full = GenerationRequest(check.segments, Mode.FULL, sampling=sampling, keep_logits=True, priority=CHECK_PRIORITY,
                             cache_salt=check.cache_salt)
    return [full] + [GenerationRequest(check.segments, c.mode, c.seam, sampling, exact_prefix=check.exact_prefix,
                                       exact_runs=False, keep_logits=True, priority=CHECK_PRIORITY, cache_salt=check.cache_salt,
                                       recompute=c.recompute)
                     for c in check.choices]


def compare(check: ShadowCheck, outputs: list[list[StepOutput]]) -> list[CheckResult]:
    """Each configuration's outputs against full prefill's (`outputs` in `check_requests` order).
    Raises RuntimeError when a request of the check failed."""
    for outs in outputs:
        if not outs or outs[-1].finish_reason == "error" or outs[0].logits is None:
            error = outs[-1].error if outs else None
            raise RuntimeError(f"a shadow-check request failed: {error!r}") from error
    full, *served = outputs
    reference = full[0].logits.log_softmax(-1)
    full_tokens = [o.token_id for o in full if o.token_id is not None]
    results = []
    for choice, outs in zip(check.choices, served):
        logits = outs[0].logits
        logq = logits.log_softmax(-1)
        kl = max(0.0, float((reference.exp() * (reference - logq)).sum()))
        top1 = int(logits.argmax()) == int(full[0].logits.argmax())
        greedy = [o.token_id for o in outs if o.token_id is not None] == full_tokens if check.greedy else None
        results.append(CheckResult(choice, kl, top1, greedy))
    return results


def run_check(engine: Engine, check: ShadowCheck, answer_tokens: int) -> list[CheckResult]:
    """Run `check` at once through `engine.step()` (tests, benchmarks; the gateway's checks go through
    the engine thread's step loop instead). Call only while no other caller steps the engine."""
    seqs = [engine.add_request(r, collect=True) for r in check_requests(check, answer_tokens)]
    outputs: list[list[StepOutput]] = [[] for _ in seqs]
    while not all(s.finished for s in seqs):
        engine.step()
    for outs, seq in zip(outputs, seqs):
        outs.extend(seq.outbox)
    return compare(check, outputs)


class InFlight:
    """A check whose requests the engine thread's step loop is running: their outputs so far."""

    def __init__(self, check: ShadowCheck, n: int) -> None:
        self.check = check
        self.outputs: list[list[StepOutput]] = [[] for _ in range(n)]
        self.left = n
