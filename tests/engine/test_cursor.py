"""One cursor per sequence: `Sequence.num_computed_tokens` is the number of its tokens whose state is in
its cache, and everything else about its progress follows from it: a restored exact snapshot moves it
as a prefix hit does (in its first step), each forward is fed at it and moves it by the tokens fed, the
stitch moves it past the stitched segments and the question tokens it took, each decode token by one, a
verified draft by the tokens kept; `prefill_left` is the model work left from it. It moves in one place,
the step's update (output.py `move_cursors`), from what the executor reports: test_structure.py checks
that no other code writes it."""

from __future__ import annotations

from engines import engine, random_segments, request


def fed_at(eng, log):
    """Record (start, tokens) of every forward and stitch the runner is asked for."""
    forward, stitch = eng.runner.forward, eng.runner.stitch

    def spy_forward(ids, start, cache, logits=False):
        log.append(("forward", start, len(ids)))
        return forward(ids, start, cache, logits=logits)

    def spy_stitch(cache, context, entries, question, transition, start=0, **kw):
        log.append(("stitch", start, sum(len(s) for s in context) + len(question)))
        return stitch(cache, context, entries, question, transition, start=start, **kw)

    eng.runner.forward, eng.runner.stitch = spy_forward, spy_stitch


def test_a_chunked_full_prefill_is_fed_at_the_cursor_and_moves_it_by_each_chunk():
    eng = engine(max_step_tokens=16, decode_step="module")
    segs = random_segments((20, 18, 13), seed=3)
    prompt = sum(map(len, segs))
    log = []
    fed_at(eng, log)
    seq = eng.add_request(request(segs, "full", max_tokens=4), collect=True)
    cursors, lefts = [], []
    while not seq.finished:
        eng.step()
        cursors.append(seq.num_computed_tokens)
        lefts.append(seq.prefill_left)
    assert cursors[:4] == [16, 32, 48, prompt]  # the step's budget each time, the last step the rest
    assert lefts[:4] == [prompt - 16, prompt - 32, prompt - 48, 0]
    assert [e[1] for e in log[:4]] == [0, 16, 32, 48]  # each chunk starts where the cursor stood
    decodes = log[4:]
    assert [e[1] for e in decodes] == list(range(prompt, prompt + len(decodes)))  # one token a step after that
    assert len(seq.output_ids) == 4 and cursors[-1] == prompt + 3  # the last token is never fed back


def test_a_restored_snapshot_moves_the_cursor_in_its_first_step_before_any_forward():
    eng = engine(exact_repeats=True)
    segs = random_segments((14, 20, 16, 6), seed=4)
    for _ in range(2):  # first sighting composes; the second computes the run exactly and keeps it
        list(eng.generate(request(segs)))
    seq = eng._sequence(request(segs))
    seq.first_scheduled = seq.arrival
    eng.cache_manager.plan(seq)
    exact = 14 + 20 + 16
    assert seq.stats.exact_tokens == exact and seq.prefill.in_cache == exact
    assert seq.num_computed_tokens == 0  # laying out moves no cursor: the first step's update does
    assert seq.prefill_left == 6  # only the question is left to run
    log = []
    fed_at(eng, log)
    out = next(iter(eng.generate(request(segs))))
    assert out.stats.exact_tokens == exact and log[0][1:] == (exact, 6)  # the question, fed at the cursor


def test_the_stitch_moves_the_cursor_past_the_stitched_segments_and_the_question_head():
    eng = engine(seam=4, max_step_tokens=14)
    segs = random_segments((10, 12, 9, 7), seed=5)
    list(eng.generate(request(segs)))
    eng.drain_background()
    log = []
    fed_at(eng, log)
    seq = eng.add_request(request(segs, max_tokens=2), collect=True)
    eng.step()  # seam heads 4 + 4 + 4 and 2 question tokens fit the budget of 14
    context = 10 + 12 + 9
    assert log == [("stitch", 0, context + 2)]
    assert seq.num_computed_tokens == context + 2 and seq.prefill_left == 5
    eng.step()
    assert log[1] == ("forward", context + 2, 5) and seq.num_computed_tokens == context + 7
