"""The scheduler alone (no model): budgets, admission order and limits, aborts; and the byte-budget LRU."""

from __future__ import annotations

import pytest

from hypic_core.cache.byte_lru import ByteLRU
from hypic_core.config import GenerationRequest
from hypic_core.engine.scheduler import Scheduler, SchedulerConfig
from hypic_core.engine.sequence import Sequence, Status


def seq(prompt: int, reserved: int = 1) -> Sequence:
    return Sequence(GenerationRequest(((1,) * (prompt - 1), (2,))), 0, None, None, frozenset(), 8, reserved)


def test_budget_goes_to_decodes_then_prefills_in_order():
    s = Scheduler(SchedulerConfig(max_running=4, max_step_tokens=100))
    a, b, c = seq(70), seq(50), seq(10)
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()
    assert [(x, n) for x, n in step.prefills] == [(a, 70), (b, 30)] and not step.decodes
    assert c.status is Status.WAITING and a.status is b.status is Status.PREFILLING  # no budget left for c
    a.status, a.num_computed_tokens, b.num_computed_tokens = Status.RUNNING, 70, 30  # what the executor ran
    assert (a.prefill_left, b.prefill_left, c.prefill_left) == (0, 20, 10)
    step = s.schedule()  # a decodes (1 token), b continues first, then c is admitted
    assert step.decodes == [a] and step.prefills == [(b, 20), (c, 10)]


def test_the_context_cache_lays_out_the_real_work_before_the_grant():
    warm, other = seq(500), seq(40)

    class Context:
        def plan(self, x):
            if x is warm:
                x.num_computed_tokens = 470  # a restored snapshot moves the cursor, as a prefix hit does

    s = Scheduler(SchedulerConfig(max_running=4, max_step_tokens=100), Context())
    s.add(warm)
    s.add(other)
    assert s.schedule().prefills == [(warm, 30), (other, 40)]


def test_the_priority_policy_admits_lower_priority_values_first_and_keeps_arrival_order_among_equals():
    def pseq(prompt, priority):
        return Sequence(GenerationRequest(((1,) * (prompt - 1), (2,)), priority=priority), 0, None, None, frozenset(), 8, 1)

    late, urgent, low, also_urgent = pseq(10, 0), pseq(10, -1), pseq(10, 5), pseq(10, -1)
    for policy, order in (("priority", [urgent, also_urgent, late, low]), ("fcfs", [late, urgent, low, also_urgent])):
        s = Scheduler(SchedulerConfig(max_running=1, max_step_tokens=100), policy=policy)
        for x in (late, urgent, low, also_urgent):
            x.status = Status.WAITING
            s.add(x)
        admitted = []
        while len(s):
            (x, _), = s.schedule().prefills
            admitted.append(x)
            s.finish(x)
        assert admitted == order, policy
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(policy="lifo")


def test_admission_limits_count_and_memory_first_come_first_served():
    s = Scheduler(SchedulerConfig(max_running=2, max_step_tokens=1000, running_budget_bytes=100))
    big, small1, small2 = seq(5, reserved=80), seq(5, reserved=30), seq(5, reserved=10)
    for x in (big, small1, small2):
        s.add(x)
    assert [x for x, _ in s.schedule().prefills] == [big]  # small1 does not fit next to big; small2 may not overtake
    s.finish(big)
    assert [x for x, _ in s.schedule().prefills] == [small1, small2]
    assert not s.can_ever_fit(seq(5, reserved=101))


def test_aborted_sequences_leave_every_queue():
    s = Scheduler(SchedulerConfig(max_running=1, max_step_tokens=10))
    a, b = seq(5), seq(5)
    s.add(a)
    s.add(b)
    s.schedule()
    a.abort.abort()
    b.abort.abort()
    step = s.schedule()
    assert set(step.aborted) == {a, b} and len(s) == 0


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_step_tokens=0)


class Item:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_byte_lru_evicts_least_recent_and_refuses_oversized():
    lru: ByteLRU[str, Item] = ByteLRU(10)
    a, b, c = Item(4), Item(4), Item(4)
    assert lru.put("a", a) == [] and lru.put("b", b) == []
    assert lru.get("a") is a  # b is now least recent
    assert lru.put("c", c) == [("b", b)] and lru.nbytes == 8
    big = Item(11)
    assert lru.put("a", big) == [("a", big)] and "a" not in lru and lru.nbytes == 4  # replaced, then refused
    assert lru.pop("missing") is None and len(lru) == 1
