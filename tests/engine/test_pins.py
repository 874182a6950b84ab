"""Behaviours of the step that a restructuring of the engine must keep (pinned before moving code):

- the stitch takes the first question tokens in the same forward (as many as the step's budget
  leaves after the seam heads); the rest of the question runs as plain forwards in later steps;
- the prefill pool is waited on only when every sequence of the step is blocked on a cold entry
  (and nothing decodes); otherwise it is polled and the step goes on;
- an exact run's snapshot is taken once, after its last boundary run, even when the run spreads
  over several steps.
"""

from __future__ import annotations

from engines import FakePool, engine, random_segments, request


def spy(obj, name, log, record):
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        log.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def warm(eng, segments):
    """Put the entries of `segments`' context in `eng`'s store (one request, drained)."""
    list(eng.generate(request(segments)))
    eng.drain_background()


def test_the_stitch_takes_the_whole_question_when_the_budget_allows():
    eng = engine(seam=4)
    segs = random_segments((10, 12, 9, 7), seed=1)
    warm(eng, segs)
    log = []
    spy(eng.runner, "stitch", log, lambda cache, context, entries, question, *a, **k: ("stitch", len(question)))
    spy(eng.runner, "forward", log, lambda ids, start, cache, logits=False: ("forward", len(ids)))
    out = next(iter(eng.generate(request(segs))))
    assert out.stats.segment_hits == 3
    assert log == [("stitch", 7)]  # seam heads and the whole question in one forward, nothing after


def test_a_short_budget_cuts_the_question_after_the_seam_heads():
    eng = engine(seam=4, max_step_tokens=15)
    segs = random_segments((10, 12, 9, 7), seed=2)
    warm(eng, segs)
    full = eng.prefill(request(segs, "full")).logits
    log = []
    spy(eng.runner, "stitch", log, lambda cache, context, entries, question, *a, **k: ("stitch", len(question)))
    spy(eng.runner, "forward", log, lambda ids, start, cache, logits=False: ("forward", len(ids), start))
    # Seams covering the context (31 tokens, over the budget of 15): the answer is full's, and the
    # stitch still takes one question token.
    outs = list(eng.generate(request(segs, seam=12)))
    assert log[0] == ("stitch", 1)
    assert [e[0] for e in log[1:]] == ["forward"] * (len(log) - 1)
    assert sum(e[1] for e in log) == 7 and log[1][2] == 10 + 12 + 9 + 1
    assert (outs[0].logits - full).abs().max().item() <= 1e-4


def test_the_question_rides_the_stitch_up_to_the_budget():
    eng = engine(seam=4, max_step_tokens=12 + 3)  # 3 seam heads of 4 tokens, then 3 question tokens
    segs = random_segments((10, 12, 8, 7), seed=3)
    warm(eng, segs)
    log = []
    spy(eng.runner, "stitch", log, lambda cache, context, entries, question, *a, **k: ("stitch", tuple(question)))
    spy(eng.runner, "forward", log, lambda ids, start, cache, logits=False: ("forward", tuple(ids), start))
    out = next(iter(eng.generate(request(segs))))
    assert out.stats.segment_hits == 3
    question = segs[-1]
    assert log[0] == ("stitch", question[:3])
    assert log[1:] == [("forward", question[3:], 10 + 12 + 8 + 3)]


def cold_request(seed):
    return request(random_segments((9, 11, 8, 5), seed=seed), cache_store=True)


def test_the_pool_is_waited_on_when_every_sequence_is_blocked():
    pool = FakePool()
    eng = engine(seam=4, prefill_pool=pool)
    outs = list(eng.generate(cold_request(10)))
    assert outs[-1].finish_reason == "length" and outs[0].stats.segment_misses == 3
    assert "wait" in pool.calls and len(eng.store) == 3  # its entries came from the pool


def test_the_pool_is_polled_not_waited_on_while_a_sequence_decodes():
    pool = FakePool()
    eng = engine(seam=4, prefill_pool=pool)
    running = eng.add_request(request(random_segments((6, 5), seed=11), "full", max_tokens=40), collect=True)
    while not running.outbox:
        eng.step()
    cold = eng.add_request(cold_request(12), collect=True)
    pool.calls.clear()
    for _ in range(3):
        eng.step()
    assert "submit" in pool.calls and "wait" not in pool.calls and "poll" in pool.calls
    assert not cold.outbox  # blocked on its entries, which only a wait computes


def test_the_pool_is_not_waited_on_while_another_prefill_can_advance():
    pool = FakePool()
    eng = engine(seam=4, prefill_pool=pool)
    cold = eng.add_request(cold_request(13), collect=True)
    plain = eng.add_request(request(random_segments((30, 20), seed=14), "full"), collect=True)
    eng.step()  # both admitted: `plain` advances, `cold` waits for the pool without blocking the step
    assert pool.calls[:2] == ["submit", "poll"] and "wait" not in pool.calls
    assert plain.outbox and not cold.outbox


def test_the_snapshot_is_taken_once_after_the_last_boundary_run():
    eng = engine(seam=4, max_step_tokens=8, exact_budget_bytes=1 << 26)
    segs = random_segments((6, 9, 7, 5), seed=20)
    log = []
    spy(eng.runner, "forward", log, lambda ids, start, cache, logits=False: ("forward", start + len(ids)))
    spy(eng.runner, "exact_snapshot", log, lambda cache, boundaries, linear: ("snapshot", tuple(boundaries)))
    list(eng.generate(request(segs, "prefix")))
    snaps = [e for e in log if e[0] == "snapshot"]
    assert snaps == [("snapshot", (6, 15, 22))]
    at = log.index(snaps[0])
    assert max(e[1] for e in log[:at]) == 22  # every context token ran before it
    assert all(e[1] > 22 for e in log[at + 1:])  # only the question after it
    assert sum(1 for e in log[:at] if e[0] == "forward") >= 3  # the run did spread over steps
    again = next(iter(eng.generate(request(segs, "prefix"))))
    assert again.stats.exact_tokens == 22
