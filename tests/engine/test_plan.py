"""The planner as a table: a request and fake cache lookups in, the frozen `Plan` out (no model, no
manager). Each row states what the cache holds (a snapshot of the first `restored` segments, the
number of leading segments seen before, which context segments hit the store) and the plan
expected: which segments are exact and restored, and what runs after them."""

from __future__ import annotations

import dataclasses

import pytest

import engines  # noqa: F401 - puts tests/ on the path
from hypic_core.config import EngineConfig, GenerationRequest
from hypic_core.errors import InvalidRequestError
from hypic_core.engine.plan import CostModel, Plan, RunHit, looks_up, make_plan

CONTEXT = ((1,) * 20, (2,) * 30, (3,) * 25, (4,) * 40)  # four context segments, then the question
QUESTION = (9,) * 6
SNAPSHOT = object()


class FakeView:
    """What the cache "holds": `restored` leading segments in a snapshot, `seen` seen before, `hits`
    the indices of context segments in the store; `in_flight` maps a segment to (done, finished)."""

    def __init__(self, config=None, restored=0, seen=0, hits=(), in_flight=None, cost=None, workers=1, head=4):
        self.config = config or EngineConfig(seam=4)
        self.cost, self.workers = cost, workers
        self.restored, self.seen, self.hits, self.flight, self.width = restored, seen, set(hits), in_flight or {}, head
        self.asked: list = []

    def longest_run(self, segments):
        self.asked.append(("run", len(segments)))
        n = min(self.restored, len(segments))
        return RunHit(SNAPSHOT if n else None, n, max(n, min(self.seen, len(segments))))

    def find(self, first):
        self.asked.append(("find", first))
        return [("entry", i) if i >= first and i in self.hits else None for i in range(len(CONTEXT))]

    def head(self, segment):
        return self.width

    def in_flight(self, segment):
        return self.flight.get(segment)


def req(mode="hypic", exact_prefix=0, exact_runs=True, cache_store=True, context=CONTEXT):
    return GenerationRequest((*context, QUESTION), mode=mode, exact_prefix=exact_prefix, exact_runs=exact_runs,
                             cache_store=cache_store)


CHEAPER = EngineConfig(seam=4, exact_repeats=True, repeats="cheaper")
WARM_WINS = CostModel(attention=0.001, entry_overhead=0.3)  # with entries stored, the stitch is a few heads
ENTRIES_DEAR = CostModel(attention=0.0001, entry_overhead=5.0)  # computing entries costs more than a forward


def summary(p: Plan) -> tuple:
    return p.rest, p.exact, p.restored, p.see, tuple(p.misses)


ROWS = [
    # id, request, view, expected (rest, exact, restored, see, misses)
    ("full", req("full"), FakeView(restored=3, hits=(0, 1)), ("whole", 0, 0, False, ())),
    ("prefix-cold", req("prefix"), FakeView(), ("question", 4, 0, False, ())),
    ("prefix-restores-what-a-snapshot-holds", req("prefix"), FakeView(restored=2), ("question", 4, 2, False, ())),
    ("hypic-all-hit", req(), FakeView(hits=(0, 1, 2, 3)), ("stitch", 0, 0, False, ())),
    ("pic-naive-all-hit", req("pic-naive"), FakeView(hits=(0, 1, 2, 3)), ("stitch", 0, 0, False, ())),
    ("hypic-some-miss", req(), FakeView(hits=(1, 3)), ("stitch", 0, 0, False, (0, 2))),
    ("hypic-exact-prefix", req(exact_prefix=2), FakeView(hits=(0, 1, 2)), ("stitch", 2, 0, False, (3,))),
    ("hypic-exact-prefix-restored", req(exact_prefix=2), FakeView(restored=4, hits=(2, 3)), ("stitch", 2, 2, False, ())),
    ("repeats-off-ignore-a-longer-snapshot", req(), FakeView(restored=3, seen=3, hits=(0, 1, 2, 3)),
     ("stitch", 0, 0, False, ())),
    ("repeats-restore-and-extend-to-what-was-seen",
     req(), FakeView(EngineConfig(seam=4, exact_repeats=True), restored=1, seen=3, hits=(3,)), ("stitch", 3, 1, True, ())),
    ("repeats-no-store-restore-but-no-sighting",
     req(cache_store=False), FakeView(EngineConfig(seam=4, exact_repeats=True), restored=2, seen=3, hits=(2, 3)),
     ("stitch", 2, 2, False, ())),
    ("repeats-not-for-composition-requests",
     req(exact_runs=False), FakeView(EngineConfig(seam=4, exact_repeats=True), restored=2, seen=3, hits=(0, 1, 2, 3)),
     ("stitch", 0, 0, False, ())),
    # repeats "cheaper": a run seen before (no snapshot yet) is computed exactly only when the cost model
    # puts its forward at no more than composing it from the store.
    ("cheaper-composes-a-warm-repeat", req(), FakeView(CHEAPER, seen=4, hits=(0, 1, 2, 3), cost=WARM_WINS),
     ("stitch", 0, 0, True, ())),
    ("cheaper-composes-past-the-snapshot", req(), FakeView(CHEAPER, restored=1, seen=3, hits=(1, 2, 3), cost=WARM_WINS),
     ("stitch", 1, 1, True, ())),
    ("cheaper-computes-a-cold-repeat", req(), FakeView(CHEAPER, seen=4, cost=ENTRIES_DEAR), ("stitch", 4, 0, True, ())),
    ("cheaper-without-a-cost-model-computes", req(), FakeView(CHEAPER, seen=4, hits=(0, 1, 2, 3)),
     ("stitch", 4, 0, True, ())),
    ("exact-rule-computes-a-warm-repeat", req(), FakeView(EngineConfig(seam=4, exact_repeats=True), seen=4,
                                                          hits=(0, 1, 2, 3), cost=WARM_WINS), ("stitch", 4, 0, True, ())),
    ("entry-prefix-makes-the-first-exact", req(), FakeView(EngineConfig(seam=4, entry_prefix=(7, 7)), hits=(1, 2, 3)),
     ("stitch", 1, 0, False, ())),
    ("cold-exact-all-miss-one-forward", req(), FakeView(EngineConfig(seam=4, cold_prefill="exact")), ("forward", 0, 0, False, (0, 1, 2, 3))),
    ("cold-exact-partial-miss-stitches", req(), FakeView(EngineConfig(seam=4, cold_prefill="exact"), hits=(1,)),
     ("stitch", 0, 0, False, (0, 2, 3))),
    ("cold-exact-not-for-composition-requests", req(exact_runs=False), FakeView(EngineConfig(seam=4, cold_prefill="exact")),
     ("stitch", 0, 0, False, (0, 1, 2, 3))),
]


@pytest.mark.parametrize("request_, view, expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_plan_table(request_, view, expected):
    p = make_plan(request_, view)
    assert summary(p) == expected
    assert p.transition == (request_.mode.value != "pic-naive")
    assert (p.snapshot is SNAPSHOT) == (p.restored > 0)
    if p.rest in ("stitch", "forward"):
        finds = [a[1] for a in view.asked if a[0] == "find"]  # looked up once, after the exact run (after the
        may_compose = view.config.repeats == "cheaper" and view.cost is not None  # restored part when a repeat
        assert finds == [p.restored if may_compose else p.exact]  # may still compose)
        assert p.heads == (4,) * (len(CONTEXT) - p.exact)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.exact = 1


def test_the_heads_are_the_views():
    view = FakeView(hits=(0, 1, 2, 3), head=11)
    assert make_plan(req(exact_prefix=1), view).heads == (11, 11, 11)


def test_auto_weighs_the_cold_work_against_one_forward():
    config = EngineConfig(seam=4, cold_prefill="auto")
    dear_attention = CostModel(attention=0.05, entry_overhead=0.1)  # long forwards are dear: stitch
    dear_entries = CostModel(attention=0.0001, entry_overhead=5.0)  # entries are dear: one forward
    assert make_plan(req(), FakeView(config, cost=dear_attention)).rest == "stitch"
    assert make_plan(req(), FakeView(config, cost=dear_entries)).rest == "forward"
    # Work already done on the misses (another request computes them) counts for the stitch.
    done = {seg: (0, True) for seg in CONTEXT}
    assert make_plan(req(), FakeView(config, cost=dear_entries, in_flight=done)).rest == "stitch"
    # No cost model: the stitch.
    assert make_plan(req(), FakeView(config)).rest == "stitch"


def test_which_modes_look_up():
    assert [m for m in ("full", "prefix", "pic-naive", "hypic") if looks_up(req(m).mode)] == ["pic-naive", "hypic"]


def test_cheaper_repeats_weigh_the_run_against_composing_it():
    """The turning point is the cost model's: composing pays the missing entries, computing pays the
    forward; a repeat whose entries are half in the store composes while entries stay cheap."""
    half = FakeView(CHEAPER, seen=4, hits=(0, 1), cost=CostModel(attention=0.001, entry_overhead=0.3))
    assert make_plan(req(), half).exact == 0
    dear = FakeView(CHEAPER, seen=4, hits=(0, 1), cost=CostModel(attention=0.001, entry_overhead=3.0))
    assert make_plan(req(), dear).exact == 4
    # Entries being computed by another request count as done.
    done = {seg: (0, True) for seg in CONTEXT}
    assert make_plan(req(), FakeView(CHEAPER, seen=4, cost=ENTRIES_DEAR, in_flight=done)).exact == 0


def test_repeats_is_validated():
    with pytest.raises(InvalidRequestError, match="repeats"):
        EngineConfig(repeats="sometimes")
