"""The guard's whole-answer watch (app/service/guard/): the faithfulness estimate (identical N-token answers
with a Wilson interval), the threshold it is held to (the operator's, else the model card's release
measurement), and live gateways on the bundled hypic-tiny, which read its card: a deliberately unfaithful
setting trips within 50 requests, a faithful one does not trip in 500."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from app.http.server import create_app
from app.service.guard import (CheckResult, Choice, Guard, GuardConfig, GuardPolicy, GuardState, Release, load_release,
                               release_for, wilson_interval)
from app.testing import LiveServer, single_torch_thread
from hypic_core.config import GenerationRequest, Mode
from retrieval import HashingEmbedder, VectorIndex

import gateways
from helpers import ROOT
from test_guard import guard_health, metric, wait_checks

HYPIC8 = Choice(Mode.HYPIC, 8)
RELEASE = Release(identical=0.9, low=0.85, high=0.94, n=400, answer_tokens=32, config="hypic:8", source="card")


def answers(p: GuardPolicy, choice: Choice, identical) -> list:
    """Record answer checks (first tokens always agreeing) and return the actions they triggered."""
    return [a for a in (p.record(CheckResult(choice, 0.0, True, ok)) for ok in identical) if a is not None]


def watch(**config) -> GuardPolicy:
    release = config.pop("release", None)
    defaults = dict(window=50, min_checks=20, min_agreement=0.0, max_seam=32, max_recompute=0.0)  # top-1 watch off
    return GuardPolicy(HYPIC8, GuardConfig(**(defaults | config)), release)


def test_the_estimate_is_the_share_of_identical_answers_with_its_wilson_interval():
    p = watch()
    answers(p, HYPIC8, [True, False, True, True])
    p.record(CheckResult(HYPIC8, 0.0, False))  # a first-token-only check: not an answer
    w = p.window(HYPIC8)
    assert w.answers == 4 and w.faithfulness == wilson_interval(3, 4) and w.faithfulness.estimate == 0.75
    low, high = w.faithfulness.low, w.faithfulness.high
    assert 0.0 < low < 0.75 < high < 1.0
    assert wilson_interval(0, 5).low == 0.0 and wilson_interval(5, 5).high == 1.0
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


def test_it_trips_only_beyond_the_windows_noise():
    at_threshold = watch(min_faithfulness=0.8)
    assert answers(at_threshold, HYPIC8, [i % 5 != 0 for i in range(200)]) == []  # 80%: as good as asked
    poor = watch(min_faithfulness=0.8)
    assert answers(poor, HYPIC8, [i % 2 == 0 for i in range(19)]) == []  # under min_checks answers: not judged
    [widen] = answers(poor, HYPIC8, [False])  # 10 of 20
    assert widen.action == "widen" and poor.state is GuardState.WIDENED
    assert "identical 32-token answers 0.500 (95% CI 0.299-0.701) < 0.800 (operator)" in widen.reason
    assert "top-1" not in widen.reason  # the first tokens all agreed


def test_the_threshold_is_the_operators_else_the_release_measurements_lower_end():
    assert watch(release=RELEASE).threshold == 0.85 and watch(release=RELEASE).threshold_source == "release"
    assert watch(release=RELEASE, min_faithfulness=0.5).threshold == 0.5
    assert watch(release=RELEASE, answer_tokens=8).threshold is None  # measured over other answers: not comparable
    unmeasured = watch()
    assert unmeasured.threshold is None and answers(unmeasured, HYPIC8, [False] * 50) == []  # reported, not acted on


def test_recovery_needs_the_estimate_back_at_the_threshold():
    p = watch(release=RELEASE)
    answers(p, HYPIC8, [False] * 20)
    assert p.state is GuardState.WIDENED
    assert answers(p, HYPIC8, [True] * 41) == []  # 41 of 50: 0.82 < 0.85
    [recover] = answers(p, HYPIC8, [True] * 2)  # 43 of 50 = 0.86
    assert recover.action == "recover" and "0.860" in recover.reason and ">= 0.850 (release)" in recover.reason


def test_a_model_without_a_measurement_checks_a_whole_window_densely(tiny_tokenizer):
    with gateways.engine(tiny_tokenizer) as engine:
        config = GuardConfig(sample_rate=0.0, dense_checks=5, window=30, min_checks=10)
        unmeasured = Guard(config, engine, "tiny", HYPIC8, CollectorRegistry(), rng=random.Random(0))
        measured = Guard(config, engine, "tiny", HYPIC8, CollectorRegistry(), rng=random.Random(0), release=RELEASE)
        segments = ((5, 6, 7), (10, 11), (8, 9))
        assert sum(unmeasured.offer(GenerationRequest(segments)) for _ in range(40)) == 30
        assert sum(measured.offer(GenerationRequest(segments)) for _ in range(40)) == 5
        health = measured.health()["faithfulness"]
        assert health["threshold"] == 0.85 and health["threshold_from"] == "release" and health["release"]["n"] == 400
        assert health["estimate"] is None and health["answers"] == 0 and health["answer_tokens"] == 32
        assert unmeasured.health()["faithfulness"]["threshold"] is None


def test_release_cards_load_or_name_what_is_wrong(tmp_path):
    good = {"model": "m", "config": "hypic:8", "answer_tokens": 32, "n": 100, "identical": 0.5, "low": 0.4, "high": 0.6}
    card = tmp_path / "faithfulness.json"
    card.write_text(json.dumps(good))
    assert load_release(card) == Release(0.5, 0.4, 0.6, 100, 32, "hypic:8", str(card))
    assert release_for("no-such-model", tmp_path).identical == 0.5 and release_for("no-such-model") is None
    for change, field in [({"identical": 1.5}, "'identical'"), ({"low": 0.55}, "'low' <= 'identical'"), ({"n": 0}, "'n'"),
                          ({"config": None}, "'config'")]:
        card.write_text(json.dumps(good | change))
        with pytest.raises(ValueError, match=field):
            load_release(card)
    card.write_text("{")
    with pytest.raises(ValueError, match="not a readable JSON"):
        load_release(card)
    shipped = sorted((ROOT / "models").glob("*/faithfulness.json"))
    assert ROOT / "models" / "hypic-tiny" / "faithfulness.json" in shipped
    for path in shipped:
        release = load_release(path)
        assert release.answer_tokens == 32 and release.n >= 20 and path.parent.name in json.loads(path.read_text())["model"]


# --- live gateways on hypic-tiny, its model card read at load -----------------------------------
CORPUS = [json.loads(line) for line in (ROOT / "data" / "demo_corpus.jsonl").read_text().splitlines()]
QUESTIONS = ["Which company does {} work for?", "Who is the mayor of {}?", "In which city is {} based?",
             "Which river flows through {}?", "Who founded {}?"]


def tiny_gateway(root: Path, **overrides) -> LiveServer:
    """A gateway that loads the bundled hypic-tiny by name (so its model card is read), over an empty index."""
    app = create_app(gateways.settings(root, model="hypic-tiny", guard_sample_rate=1.0, **overrides),
                     index=VectorIndex(root / "index", HashingEmbedder(64)))
    return LiveServer(app)


def ask(url: str, i: int, documents: int = 4, max_tokens: int = 4) -> httpx.Response:
    rng = random.Random(i)
    docs = rng.sample(CORPUS, documents)
    body = {"model": "hypic-tiny", "prompt": rng.choice(QUESTIONS).format(rng.choice(docs)["title"]), "max_tokens": max_tokens,
            "temperature": 0, "segments": [d["text"] for d in docs]}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_an_unfaithful_setting_trips_within_50_requests(tmp_path):
    """pic-naive without a seam, held to an operator threshold of 0.95 identical answers (on these prompts it
    keeps about 0.7; hypic-tiny's card, 0.83 with a 95% interval down to 0.70 over 48 prompts, is shown beside
    it). The top-1 watch is off (min agreement 0), so what trips is the whole-answer watch."""
    with single_torch_thread(), tiny_gateway(tmp_path, default_mode="pic-naive", seam=0, guard_min_faithfulness=0.95,
                                             guard_min_agreement=0.0) as live:
        live.wait_ready()
        g = guard_health(live.url)
        assert g["faithfulness"]["threshold_from"] == "operator" and g["faithfulness"]["release"]["config"] == "hypic:8"
        for i in range(50):
            assert ask(live.url, i).status_code == 200
            g = wait_checks(live.url, i + 1, timeout=120)
            if g["state"] != "ok":
                break
        assert g["state"] == "widened", g
        f = g["faithfulness"]
        assert f["answers"] >= 20 and f["high"] < 0.95 and "identical 32-token answers" in g["last_action"]["reason"]
        assert metric(live.url, "hypic_guard_faithfulness_high", model="hypic-tiny") == pytest.approx(f["high"])
        assert metric(live.url, "hypic_guard_faithfulness_threshold", model="hypic-tiny") == 0.95


def test_a_faithful_setting_does_not_trip_in_500_requests(tmp_path):
    """A seam over every document gives full's answers: 500 requests, every one checked, held to the card's threshold."""
    with single_torch_thread(), tiny_gateway(tmp_path, seam=512) as live:
        live.wait_ready()
        g = guard_health(live.url)
        card = load_release(ROOT / "models" / "hypic-tiny" / "faithfulness.json")
        assert g["faithfulness"]["threshold_from"] == "release" and g["faithfulness"]["threshold"] == card.low
        for i in range(500):
            assert ask(live.url, i, documents=2, max_tokens=1).status_code == 200
            g = wait_checks(live.url, i + 1, timeout=120)  # one check at a time: none dropped from the queue
        assert g["state"] == "ok" and g["last_action"] is None and g["checks"] == 500 and g["errors"] == 0
        f = g["faithfulness"]
        assert f["estimate"] == 1.0 and f["answers"] == 50
        assert metric(live.url, "hypic_guard_faithfulness", model="hypic-tiny") == 1.0
