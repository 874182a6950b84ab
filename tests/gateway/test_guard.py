"""The online accuracy guard (app/service/guard/): the policy on synthetic check results, shadow checks
on a real engine, and the guard in a live gateway (it trips where reuse is poor, not where it is
exact, runs only while the engine is idle, never changes served answers), and `exact: true`."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from app.service.guard import (CHECK_PRIORITY, CheckResult, Choice, Guard, GuardConfig, GuardPolicy, GuardState, ShadowCheck,
                               Window, check_requests, exact_mode, run_check)
from app.http.server import create_app
from app.service.settings import Settings
from app.testing import LiveServer, single_torch_thread
from hypic_core.config import EngineConfig, GenerationRequest, Mode
from hypic_core.engine.engine import Engine
from hypic_core.errors import InvalidRequestError
from hypic_core.testing import tiny_model

import gateways
from helpers import random_segments

HYPIC8 = Choice(Mode.HYPIC, 8)
DOCS = ["The river Alna flows through Varo. Its mayor is Ines Kell. Documents about cities, rivers and companies.",
        "Question: who founded Brill? Answer: Tam Oke. The café opened in 1999 and naïve émigrés came.",
        "Documents about cities, rivers and companies. The river Alna flows through Varo.",
        "Its mayor is Ines Kell. Brill was founded by Tam Oke. The café opened in 1999.",
        "Naïve émigrés came to Varo. The Alna is a river. Who founded Brill? Tam Oke."]


def result(choice: Choice, top1: bool, greedy: bool | None = None, kl: float = 0.0) -> CheckResult:
    return CheckResult(choice, kl, top1, greedy)


def policy(base: Choice = HYPIC8, **config) -> GuardPolicy:
    defaults = dict(window=10, min_checks=4, min_agreement=0.75, max_seam=32, max_recompute=0.0)  # the seam alone
    return GuardPolicy(base, GuardConfig(**(defaults | config)))


def feed(p: GuardPolicy, choice: Choice, outcomes) -> list:
    return [a for a in (p.record(result(choice, ok)) for ok in outcomes) if a is not None]


# --- the policy -------------------------------------------------------------------------------
def test_window_keeps_the_last_results():
    w = Window(3)
    assert w.top1_agreement is None and w.greedy_agreement is None and w.mean_kl is None
    for ok, greedy, kl in [(False, None, 9.0), (True, True, 0.1), (True, None, 0.2), (False, False, 0.3)]:
        w.add(result(HYPIC8, ok, greedy, kl))
    assert len(w) == 3
    assert w.top1_agreement == pytest.approx(2 / 3) and w.greedy_agreement == 0.5 and w.mean_kl == pytest.approx(0.2)


def test_policy_waits_for_min_checks_then_widens_doubles_and_goes_exact():
    p = policy()
    assert feed(p, HYPIC8, [False] * 3) == [] and p.state is GuardState.OK and p.serving == HYPIC8
    [widen] = feed(p, HYPIC8, [False])
    assert widen.action == "widen" and widen.previous == HYPIC8 and widen.choice == Choice(Mode.HYPIC, 16)
    assert p.state is GuardState.WIDENED and p.serving == Choice(Mode.HYPIC, 16)
    assert "top-1 agreement 0.000 < 0.75 over the last 4 checks of hypic seam 8" in widen.reason
    # the base stays bad; the widened seam is judged on its own window
    assert feed(p, HYPIC8, [False] * 6) == []
    assert [a.choice for a in feed(p, Choice(Mode.HYPIC, 16), [True, False, False, False])] == [Choice(Mode.HYPIC, 32)]
    [exact] = feed(p, Choice(Mode.HYPIC, 32), [False] * 4)
    assert exact.action == "exact" and p.state is GuardState.EXACT and p.serving.mode is Mode.PREFIX
    assert "at the widest reuse (seam 32, recompute 0)" in exact.reason and p.last_action is exact


def test_the_default_ladder_widens_the_seam_and_the_recompute_budget_together():
    p = policy(max_recompute=0.2)
    ladder = [HYPIC8]
    for _ in range(3):
        [widen] = feed(p, ladder[-1], [False] * 4)
        assert widen.action == "widen"
        ladder.append(widen.choice)
    assert ladder[1:] == [Choice(Mode.HYPIC, 16, 0.05), Choice(Mode.HYPIC, 32, 0.1), Choice(Mode.HYPIC, 32, 0.2)]
    assert ladder[1].describe() == "hypic seam 16 recompute 0.05" and ladder[1].as_dict()["recompute"] == 0.05
    [exact] = feed(p, ladder[-1], [False] * 4)
    assert exact.action == "exact" and "(seam 32, recompute 0.2)" in exact.reason
    # a base already past the largest budget keeps it; the seam still widens
    assert Choice(Mode.HYPIC, 8, 0.5).wider(32, 0.2) == Choice(Mode.HYPIC, 16, 0.5)
    assert Choice(Mode.HYPIC, 32, 0.2).wider(32, 0.2) is None


def test_a_check_runs_each_configuration_with_its_recompute_budget():
    segs = ((1, 2, 3), (4, 5, 6), (7,))
    check = ShadowCheck(segs, (HYPIC8, Choice(Mode.HYPIC, 16, 0.1)), greedy=False)
    full, base, wider = check_requests(check, 8)
    assert full.mode is Mode.FULL and (base.recompute, wider.recompute) == (0.0, 0.1) and wider.seam == 16


def test_policy_stays_widened_while_the_wider_seam_agrees():
    p = policy()
    feed(p, HYPIC8, [False] * 4)
    assert feed(p, Choice(Mode.HYPIC, 16), [True] * 10) == [] and p.state is GuardState.WIDENED


def test_policy_recovers_when_the_base_window_is_good_again():
    p = policy()
    feed(p, HYPIC8, [False] * 4)
    feed(p, Choice(Mode.HYPIC, 16), [False] * 4)
    feed(p, Choice(Mode.HYPIC, 32), [False] * 4)
    assert p.state is GuardState.EXACT
    # the window of 10 still holds the 4 misses: 7 of 10 < 0.75 ...
    assert feed(p, HYPIC8, [True] * 7) == [] and p.state is GuardState.EXACT
    [recover] = feed(p, HYPIC8, [True])  # ... 8 of 10 is enough
    assert recover.action == "recover" and p.state is GuardState.OK and p.serving == HYPIC8
    assert recover.previous.mode is Mode.PREFIX and ">= 0.75" in recover.reason


def test_recovery_needs_a_full_window():
    p = policy(min_agreement=0.5)
    feed(p, HYPIC8, [False] * 4)
    assert feed(p, HYPIC8, [True] * 5) == [] and p.state is GuardState.WIDENED  # 5 of 9: good, but not a full window
    assert [a.action for a in feed(p, HYPIC8, [True])] == ["recover"]


def test_policy_recovers_from_widened_and_ignores_other_configurations():
    p = policy()
    assert feed(p, Choice(Mode.HYPIC, 2), [False] * 10) == []  # a request that named its own seam
    feed(p, HYPIC8, [False] * 4)
    assert p.state is GuardState.WIDENED
    assert [a.action for a in feed(p, HYPIC8, [True] * 10)] == ["recover"]


def test_a_new_seam_is_judged_on_fresh_checks():
    p = policy()
    feed(p, Choice(Mode.HYPIC, 16), [False] * 4)  # old results at seam 16, before the guard served it
    feed(p, HYPIC8, [False] * 4)
    assert p.serving == Choice(Mode.HYPIC, 16) and len(p.window(Choice(Mode.HYPIC, 16))) == 0
    assert feed(p, Choice(Mode.HYPIC, 16), [False] * 3) == []


def test_policy_edge_cases():
    zero = policy(Choice(Mode.HYPIC, 0), max_seam=2)
    assert [a.choice.seam for a in feed(zero, Choice(Mode.HYPIC, 0), [False] * 4)] == [1]  # 0 doubles to 1
    widest = policy(Choice(Mode.HYPIC, 64), max_seam=64)
    assert [a.action for a in feed(widest, Choice(Mode.HYPIC, 64), [False] * 4)] == ["exact"]
    exact_base = policy(Choice(Mode.PREFIX, 8))
    assert not exact_base.active and feed(exact_base, Choice(Mode.PREFIX, 8), [False] * 10) == []
    off = policy(enabled=False)
    assert feed(off, HYPIC8, [False] * 10) == [] and off.state is GuardState.OK


def test_config_and_settings_validation():
    for bad in (dict(sample_rate=1.5), dict(min_checks=0), dict(window=5, min_checks=6), dict(max_seam=-1),
                dict(max_recompute=1.5)):
        with pytest.raises(ValueError):
            GuardConfig(**bad)
    with pytest.raises(ValidationError, match="guard_min_checks"):
        Settings(_env_file=None, guard_window=5, guard_min_checks=6)
    s = Settings(_env_file=None, guard_sample_rate=0.5, guard_max_seam=16, guard_max_recompute=0.1)
    assert GuardConfig.from_settings(s) == GuardConfig(sample_rate=0.5, max_seam=16, max_recompute=0.1)


def test_exact_mode():
    assert exact_mode(None) is Mode.PREFIX and exact_mode("full") is Mode.FULL and exact_mode("prefix") is Mode.PREFIX
    with pytest.raises(InvalidRequestError) as err:
        exact_mode("hypic")
    assert err.value.field == "exact"


# --- checks on an engine ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def poor_engine(tiny_tokenizer):
    """A hybrid model whose slow-decaying heads carry a lot across segments (larger init): reuse
    without a seam changes its first token on most prompts."""
    with single_torch_thread():
        model = tiny_model("qwen3_5", seed=0, vocab_size=len(tiny_tokenizer), initializer_range=0.2)
        yield Engine(model, tiny_tokenizer, EngineConfig(seam=0), model_id="tiny")


def test_run_check_is_exact_at_a_full_seam_and_poor_without_one(poor_engine):
    wide, none = Choice(Mode.HYPIC, 64), Choice(Mode.HYPIC, 0)
    top1 = []
    for seed in range(6):
        segments = random_segments((24, 24, 6), vocab=len(poor_engine.tokenizer), seed=seed)
        [at_wide, at_none] = run_check(poor_engine, ShadowCheck(segments, (wide, none), greedy=True), 4)
        assert at_wide.top1 and at_wide.greedy and at_wide.kl < 1e-5
        top1.append(at_none.top1)
        assert at_none.kl > at_wide.kl
    assert sum(top1) <= 3


def test_offer_samples_picks_configurations_and_drops_the_oldest(poor_engine):
    registry = CollectorRegistry()
    guard = Guard(GuardConfig(sample_rate=1.0, greedy_sample=0.0, queue_size=2), poor_engine, "tiny", HYPIC8, registry,
                  rng=random.Random(0))
    segments = ((5, 6, 7), (10, 11), (8, 9))
    assert not guard.offer(GenerationRequest(segments[1:]))  # one context segment: exact in every mode
    assert guard.offer(GenerationRequest(segments, Mode.FULL))  # any admitted request's prompt checks the base
    assert guard.offer(GenerationRequest(segments, Mode.HYPIC, 2))
    guard.policy.serving = Choice(Mode.HYPIC, 16)  # as if widened
    assert guard.offer(GenerationRequest(segments, Mode.HYPIC, 16))
    assert [c.choices for c in guard._queue] == [(HYPIC8,), (HYPIC8, Choice(Mode.HYPIC, 16))]
    health = guard.health()
    assert health["pending"] == 2 and health["dropped"] == 1 and health["state"] == "ok" and health["checks"] == 0
    assert registry.get_sample_value("hypic_guard_dropped_checks_total", {"model": "tiny"}) == 1
    never = Guard(GuardConfig(sample_rate=0.0, dense_checks=0), poor_engine, "tiny", HYPIC8, CollectorRegistry())
    assert not never.offer(GenerationRequest(segments)) and not never.pending()
    exact = Guard(GuardConfig(sample_rate=1.0), poor_engine, "tiny", Choice(Mode.PREFIX, 8), CollectorRegistry())
    assert not exact.offer(GenerationRequest(segments, Mode.PREFIX))  # nothing approximate to compare


def test_dense_checks_after_start_new_documents_and_a_widening(poor_engine):
    """Every request is checked (not sampled) for `dense_checks` checks after start, after new
    documents and after each widening, so the guard judges within the first few dozen requests."""
    guard = Guard(GuardConfig(sample_rate=0.0, dense_checks=3, window=4, min_checks=2, queue_size=64, min_faithfulness=0.5),
                  poor_engine, "tiny", HYPIC8, CollectorRegistry(), rng=random.Random(0))
    segments = ((5, 6, 7), (10, 11), (8, 9))

    def offers(n):
        return [guard.offer(GenerationRequest(segments)) for _ in range(n)]

    assert not guard.offer(GenerationRequest(segments[1:]))  # never checked: does not spend the dense phase
    assert offers(5) == [True] * 3 + [False] * 2 and guard.health()["dense_left"] == 0
    guard.new_corpus()
    assert guard.health()["dense_left"] == 3 and offers(4) == [True] * 3 + [False]
    guard._record([CheckResult(HYPIC8, 1.0, False)])
    guard._record([CheckResult(HYPIC8, 1.0, False)])  # min_checks poor results: the seam doubles
    assert guard.policy.state is GuardState.WIDENED and guard.health()["dense_left"] == 3
    assert offers(4) == [True] * 3 + [False]


# --- in a gateway -----------------------------------------------------------------------------
settings_for = gateways.settings


def serve(engine, root, **overrides) -> LiveServer:
    return LiveServer(gateways.app(root, engine, **overrides))


class AddSpy:
    """Wraps `engine.add_request` to keep every served `Sequence` (not the shadow checks' requests)."""

    def __init__(self, engine) -> None:
        self.seqs = []
        self._add = engine.add_request

    def __call__(self, request, *args, **kwargs):
        seq = self._add(request, *args, **kwargs)
        if request.priority != CHECK_PRIORITY:
            self.seqs.append(seq)
        return seq


def complete(url: str, i: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": f"Q{i}?", "max_tokens": 4, "temperature": 0,
            "segments": [DOCS[(i + 2 * k) % len(DOCS)] for k in range(3)]} | extra
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def guard_health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["guard"]


def wait_checks(url: str, n: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        g = guard_health(url)
        if g["checks"] + g["errors"] >= n and g["pending"] == 0:
            return g
        assert time.monotonic() < deadline, f"checks did not run: {g}"
        time.sleep(0.02)


def metric(url: str, name: str, **labels) -> float | None:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


TRIP = dict(guard_sample_rate=1.0, guard_greedy_sample=1.0, guard_answer_tokens=4, guard_window=6, guard_min_checks=3,
            guard_max_seam=2)


def test_poor_reuse_trips_the_guard_widen_then_exact(poor_engine, tmp_path, monkeypatch):
    spy = AddSpy(poor_engine)
    monkeypatch.setattr(poor_engine, "add_request", spy)
    with serve(poor_engine, tmp_path, **TRIP) as live:
        live.wait_ready()
        g = guard_health(live.url)
        assert g["state"] == "ok" and g["mode"] == "hypic" and g["seam"] == 0 and g["last_action"] is None
        states = []
        for i in range(40):
            assert complete(live.url, i).status_code == 200
            g = wait_checks(live.url, i + 1)
            if not states or states[-1] != (g["state"], g["seam"], g["recompute"]):
                states.append((g["state"], g["seam"], g["recompute"]))
            if g["state"] == "exact":
                break
        # each widening doubles the seam (to guard_max_seam) and the recompute budget (0.05 first, to 0.2)
        assert states[:4] == [("ok", 0, 0.0), ("widened", 1, 0.05), ("widened", 2, 0.1), ("widened", 2, 0.2)], states
        assert g["state"] == "exact", states
        assert g["mode"] == "prefix" and g["base"] == {"mode": "hypic", "seam": 0, "recompute": 0.0} and g["agreement"] < 0.9
        assert g["last_action"]["action"] == "exact" and "at the widest reuse (seam 2, recompute 0.2)" in g["last_action"]["reason"]
        served = [(s.stats.mode, s.stats.seam, s.request.recompute) for s in spy.seqs]
        assert served[0] == ("hypic", 0, 0.0) and ("hypic", 1, 0.05) in served and ("hypic", 2, 0.2) in served
        widened = next(s for s in spy.seqs if s.request.recompute == 0.2)
        assert widened.heads is not None and widened.stats.seam_tokens > 2 * (len(widened.request.context) - 1)
        # later default-mode requests run exact; requests that name a mode or seam get it
        base_checks = metric(live.url, "hypic_guard_checks_total", model="tiny", mode="hypic", seam="0")
        widest_checks = metric(live.url, "hypic_guard_checks_total", model="tiny", mode="hypic", seam="2", recompute="0.2")
        assert complete(live.url, 100).status_code == 200 and spy.seqs[-1].stats.mode == "prefix"
        assert complete(live.url, 101, seam=0).status_code == 200 and (spy.seqs[-1].stats.mode, spy.seqs[-1].stats.seam) == ("hypic", 0)
        assert complete(live.url, 102, mode="hypic").status_code == 200 and spy.seqs[-1].stats.mode == "hypic"
        # while exact, the shadow keeps checking the original configuration (only)
        wait_checks(live.url, g["checks"] + 3)
        assert metric(live.url, "hypic_guard_checks_total", model="tiny", mode="hypic", seam="0") == base_checks + 3
        assert metric(live.url, "hypic_guard_checks_total", model="tiny", mode="hypic", seam="2", recompute="0.2") == widest_checks
        assert metric(live.url, "hypic_guard_recompute", model="tiny") == 0.0  # prefix: nothing is recomputed by budget
        assert metric(live.url, "hypic_guard_state", model="tiny") == 2
        assert metric(live.url, "hypic_guard_checks_total", model="tiny", mode="hypic", seam="0") >= 3
        assert metric(live.url, "hypic_guard_kl_count", model="tiny", mode="hypic", seam="1", recompute="0.05") >= 3
        assert metric(live.url, "hypic_guard_top1_agreement", model="tiny", mode="hypic", seam="0") < 0.9
        assert metric(live.url, "hypic_guard_greedy_agreement", model="tiny", mode="hypic", seam="0") is not None
        assert metric(live.url, "hypic_guard_dropped_checks_total", model="tiny") == 0


def test_exact_reuse_does_not_trip_the_guard(poor_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(poor_engine, "config", EngineConfig(seam=128))  # longer than every segment (<= 65 tokens): exact
    with serve(poor_engine, tmp_path, **TRIP) as live:
        live.wait_ready()
        for i in range(6):
            assert complete(live.url, i).status_code == 200
            wait_checks(live.url, i + 1)
        g = guard_health(live.url)
        assert g["state"] == "ok" and g["seam"] == 128 and g["agreement"] == 1.0 and g["greedy_agreement"] == 1.0
        assert g["window_checks"] == 6 and g["checks"] == 6 and g["last_action"] is None
        assert metric(live.url, "hypic_guard_state", model="tiny") == 0


@pytest.fixture(scope="module")
def endless_engine(tiny_tokenizer):
    with gateways.engine(tiny_tokenizer, stop_at_eos=False) as engine:
        yield engine


INERT = dict(guard_sample_rate=1.0, guard_greedy_sample=1.0, guard_window=50, guard_min_checks=50)  # checks, no actions


def test_checks_wait_until_the_engine_is_idle(endless_engine, tmp_path):
    with serve(endless_engine, tmp_path, **INERT) as live:
        live.wait_ready()
        with httpx.Client(timeout=30) as client:
            body = {"model": "tiny", "prompt": "a long story", "segments": DOCS[:2], "max_tokens": 1000, "stream": True}
            with client.stream("POST", f"{live.url}/v1/completions", json=body) as long:
                lines = long.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                assert complete(live.url, 1).status_code == 200  # finishes while the long one runs
                time.sleep(0.3)
                g = guard_health(live.url)
                assert g["checks"] == 0 and g["pending"] == 2, g
                next(lines)  # still streaming
        g = wait_checks(live.url, 2)  # the long request was aborted: the engine is idle
        assert g["checks"] == 2 and g["errors"] == 0


def test_checks_never_change_served_answers(endless_engine, tmp_path, monkeypatch):
    with serve(endless_engine, tmp_path / "off", guard_enabled=False) as live:
        live.wait_ready()
        expected = [complete(live.url, i, max_tokens=8).json()["choices"][0]["text"] for i in range(3)]
        assert guard_health(live.url)["enabled"] is False
    started, release = threading.Event(), threading.Event()
    add = endless_engine.add_request

    def slow_add(request, *args, **kwargs):  # holds the first check on the engine thread until released
        if request.priority == CHECK_PRIORITY and not started.is_set():
            started.set()
            release.wait(10)
        return add(request, *args, **kwargs)

    monkeypatch.setattr(endless_engine, "add_request", slow_add)
    with serve(endless_engine, tmp_path / "on", **INERT) as live:
        live.wait_ready()
        assert complete(live.url, 0, max_tokens=8).json()["choices"][0]["text"] == expected[0]
        assert started.wait(10)  # the check of that request runs now; a request arrives meanwhile
        later = {}
        thread = threading.Thread(target=lambda: later.update(r=complete(live.url, 1, max_tokens=8)))
        thread.start()
        time.sleep(0.2)
        release.set()
        thread.join(30)
        assert later["r"].json()["choices"][0]["text"] == expected[1]
        wait_checks(live.url, 2)
        for i in range(3):
            assert complete(live.url, i, max_tokens=8).json()["choices"][0]["text"] == expected[i]
        assert wait_checks(live.url, 5)["errors"] == 0


def test_checks_are_low_priority_requests_through_the_step_loop(endless_engine, tmp_path, monkeypatch):
    """No second model path: a check is a `full` request and one per configuration, added to the engine
    at the lowest priority, keeping their first-token logits, and stepped by the engine thread's loop."""
    added = []
    add = endless_engine.add_request

    def spy(request, *args, **kwargs):
        added.append(request)
        return add(request, *args, **kwargs)

    def no_prefill(request):
        raise AssertionError("a check outside the step loop")

    monkeypatch.setattr(endless_engine, "add_request", spy)
    monkeypatch.setattr(endless_engine, "prefill", no_prefill)
    with serve(endless_engine, tmp_path, **INERT) as live:
        live.wait_ready()
        assert complete(live.url, 0).status_code == 200
        g = wait_checks(live.url, 1)
    checks = [r for r in added if r.priority == CHECK_PRIORITY]
    assert g["checks"] == 1 and g["errors"] == 0
    assert [r.mode for r in checks] == [Mode.FULL, Mode.HYPIC] and all(r.keep_logits for r in checks)
    assert not checks[1].exact_runs and checks[0].segments == checks[1].segments == added[0].segments


def test_exact_opt_out(endless_engine, tmp_path, monkeypatch):
    spy = AddSpy(endless_engine)
    monkeypatch.setattr(endless_engine, "add_request", spy)
    with serve(endless_engine, tmp_path) as live:
        live.wait_ready()
        r = httpx.post(f"{live.url}/query", json={"question": "who?", "max_tokens": 2, "exact": True}, timeout=30)
        assert r.status_code == 200 and spy.seqs[-1].stats.mode == "prefix"
        r = httpx.post(f"{live.url}/query", json={"question": "who?", "max_tokens": 2, "exact": True, "mode": "full"}, timeout=30)
        assert r.status_code == 200 and spy.seqs[-1].stats.mode == "full"
        r = httpx.post(f"{live.url}/query", json={"question": "who?", "max_tokens": 2, "exact": True, "mode": "hypic"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "exact"
        assert complete(live.url, 0, exact=True).status_code == 200 and spy.seqs[-1].stats.mode == "prefix"
        r = complete(live.url, 0, exact=True, mode="pic-naive")
        assert r.status_code == 400 and r.json()["error"]["param"] == "exact"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "who?"}], "max_tokens": 2, "exact": True,
                "segments": DOCS[:2]}
        assert httpx.post(f"{live.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        assert spy.seqs[-1].stats.mode == "prefix"
        assert complete(live.url, 0).status_code == 200 and spy.seqs[-1].stats.mode == "hypic"  # the default


def test_added_documents_start_a_dense_phase(endless_engine, tmp_path):
    with serve(endless_engine, tmp_path, guard_sample_rate=0.0, guard_dense_checks=2, guard_min_faithfulness=0.5) as live:
        live.wait_ready()
        for i in range(3):
            assert complete(live.url, i).status_code == 200
        wait_checks(live.url, 2)
        g = guard_health(live.url)
        assert g["dense_left"] == 0 and g["checks"] == 2  # the third request was not sampled (rate 0)
        r = httpx.post(f"{live.url}/documents?id=new", content="Seinaim is based in Jasteirk.",
                       headers={"content-type": "text/plain", "x-requested-with": "test"}, timeout=30)
        assert r.status_code == 201 and r.json()["chunks"] >= 1
        assert guard_health(live.url)["dense_left"] == 2
        assert complete(live.url, 3).status_code == 200
        assert wait_checks(live.url, 3)["dense_left"] == 1


def test_health_guard_is_null_until_loaded(tmp_path):
    from fastapi.testclient import TestClient

    app = create_app(settings_for(tmp_path), engine=lambda: None, index=lambda: None)
    try:
        health = TestClient(app).get("/health").json()  # no lifespan: nothing loads
        assert health["status"] == "ok" and health["guard"] is None
    finally:
        app.state.runtime.close()
