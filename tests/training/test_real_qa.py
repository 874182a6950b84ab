"""data/real_qa/: the real-text question set is well formed, and bench/real_qa.py loads and scores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "real_qa"


real_qa = load_script("bench_real_qa", ROOT / "bench" / "real_qa.py")


def _jsonl(name):
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def passages():
    return _jsonl("passages.jsonl")


@pytest.fixture(scope="module")
def questions():
    return _jsonl("questions.jsonl")


def test_files_and_fields(passages, questions):
    assert all(set(p) == {"id", "title", "text", "source", "licence"} for p in passages)
    assert all(set(q) == {"id", "passage_id", "question", "answer", "aliases", "distractors"} for q in questions)
    assert all(p["source"] and p["licence"] and p["title"] for p in passages)
    assert (DATA / "README.md").is_file() and (DATA / "build.py").is_file()
    total = sum((DATA / n).stat().st_size for n in ("passages.jsonl", "questions.jsonl", "held_out.txt"))
    assert total < 1_100_000


def test_counts_and_unique_ids(passages, questions):
    assert len(questions) >= 60 and len(passages) >= 60
    assert len({p["id"] for p in passages}) == len(passages)
    assert len({q["id"] for q in questions}) == len(questions)


def test_passages_are_100_to_400_words(passages):
    bad = {p["id"]: len(p["text"].split()) for p in passages if not 100 <= len(p["text"].split()) <= 400}
    assert not bad


def test_answers_are_short_and_occur_in_their_passage(passages, questions):
    text = {p["id"]: p["text"].lower() for p in passages}
    for q in questions:
        assert q["passage_id"] in text, q["id"]
        assert 1 <= len(q["answer"].split()) <= 5, q["id"]
        assert q["question"].strip().endswith("?"), q["id"]
        assert any(a.lower() in text[q["passage_id"]] for a in [q["answer"], *q["aliases"]]), q["id"]
        # The question is not answered by copying it: the gold answer is not in the question.
        assert real_qa.normalize_answer(q["answer"]) not in real_qa.normalize_answer(q["question"]).split(), q["id"]


def test_distractors_exist_exclude_gold_and_do_not_contain_the_answer(passages, questions):
    text = {p["id"]: p["text"].lower() for p in passages}
    for q in questions:
        d = q["distractors"]
        assert 3 <= len(d) <= 9 and len(set(d)) == len(d), q["id"]
        assert q["passage_id"] not in d, q["id"]
        assert all(i in text for i in d), q["id"]
        assert not any(a.lower() in text[i] for i in d for a in [q["answer"], *q["aliases"]]), q["id"]


def test_held_out_is_separate_prose(passages):
    held = (DATA / "held_out.txt").read_text(encoding="utf-8")
    assert 50_000 <= len(held.encode()) <= 110_000

    def runs(t, n=8):
        w = t.lower().split()
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    held_runs = runs(held)
    assert not any(runs(p["text"]) & held_runs for p in passages)


def test_loader_resolves_texts(passages, questions):
    pairs = real_qa.load_real_qa(DATA)
    assert len(pairs) == len(questions)
    by_id = {p["id"]: p["text"] for p in passages}
    first = pairs[0]
    assert first.passage == by_id[first.passage_id]
    assert first.distractors == tuple(by_id[i] for i in first.distractor_ids)
    assert first.answers == (first.answer, *first.aliases)
    assert real_qa.load_real_qa() == pairs  # the default root is the repository's data/real_qa


def test_build_context_shuffles_the_gold_passage():
    pairs = real_qa.load_real_qa(DATA)
    positions = set()
    for pair in pairs:
        chunks, gold = real_qa.build_context(pair, seed=1)
        assert len(chunks) == len(pair.distractors) + 1 and chunks[gold] == pair.passage
        assert sorted(chunks) == sorted([pair.passage, *pair.distractors])
        assert real_qa.build_context(pair, seed=1) == (chunks, gold)
        positions.add(gold)
        three, g3 = real_qa.build_context(pair, n_chunks=3, seed=2)
        assert len(three) == 3 and three[g3] == pair.passage
    assert len(positions) > 3
    with pytest.raises(ValueError):
        real_qa.build_context(pairs[0], n_chunks=len(pairs[0].distractors) + 2)


@pytest.mark.parametrize("prediction,answer,aliases,exact,f1", [
    ("ABC", "ABC", [], True, 1.0),
    ("The ABC.", "abc", [], True, 1.0),  # case, article and punctuation are ignored
    ("  Kent   Beck ", "Kent Beck", [], True, 1.0),
    ("Kent Beck's framework", "Kent Beck", ["Kent Beck's"], False, 0.8),  # best over aliases: "kent becks"
    ("16 colors", "16", ["16 colors"], True, 1.0),
    ("writeback", "writeback=True", ["writeback"], True, 1.0),
    ("Gustavo", "Gustavo Niemeyer", [], False, 2 / 3),
    ("Trio", "asyncio", [], False, 0.0),
    ("", "ABC", [], False, 0.0),
])
def test_score(prediction, answer, aliases, exact, f1):
    em, got = real_qa.score(prediction, answer, aliases)
    assert em is exact
    assert got == pytest.approx(f1)


def test_normalize_answer():
    assert real_qa.normalize_answer("The  Zope, Corporation!") == "zope corporation"
    assert real_qa.normalize_answer("An apple a day") == "apple day"
    assert real_qa.normalize_answer("(80, 24)") == "80 24"


def test_accuracy_table_counts_answers_that_start_with_whitespace_only_where_full_does_not():
    bench = load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")

    def row(ws, acc=True):
        return {"acc": acc, "f1": 1.0, "agree": True, "kl": 0.0, "cont_kl": 0.0, "top1": True, "ws": ws}

    results = {"configs": [["full", "full", 0], ["hypic s=8", "hypic", 8]],
               "rows": {"full": [row(False), row(True), row(False)], "hypic s=8": [row(True), row(True), row(False)]}}
    lines = bench.table(results)
    assert lines[2].endswith("| 0/3 |") and lines[3].endswith("| 1/3 |")  # the 2nd question's full starts with it too
    del results["rows"]["hypic s=8"][0]["ws"]  # rows of an older run: not recorded
    assert bench.table(results)[3].endswith("| n/a |")


def test_shares_of_an_accuracy_run_join_in_question_order():
    bench = load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")

    def share(first, ids, seconds):
        return {"model": "m", "configs": [["full", "full", 0]], "seed": 0, "max_tokens": 32, "first": first,
                "n": len(ids), "seconds": seconds, "rows": {"full": [{"id": i} for i in ids]}}

    joined = bench.join([share(2, [2, 3, 4], 50), share(0, [0, 1], 70)])
    assert [r["id"] for r in joined["rows"]["full"]] == [0, 1, 2, 3, 4]
    assert (joined["n"], joined["first"], joined["seconds"], joined["processes"]) == (5, 0, 70, 2)
    with pytest.raises(SystemExit, match="tile"):
        bench.join([share(0, [0, 1], 1), share(3, [3], 1)])
    other = share(2, [2], 1)
    other["seed"] = 1
    with pytest.raises(SystemExit, match="different runs"):
        bench.join([share(0, [0, 1], 1), other])


def test_accuracy_by_position_counts_answers_by_documents_between_gold_and_question(tmp_path):
    bench = load_script("bench_accuracy_by_position", ROOT / "bench" / "accuracy_by_position.py")
    rows = [{"id": "a", "chunks": 3, "gold_at": 2, "acc": True}, {"id": "b", "chunks": 10, "gold_at": 0, "acc": True},
            {"id": "c", "chunks": 5, "gold_at": 1, "acc": False}, {"id": "d", "chunks": 4, "gold_at": 2, "acc": True}]
    assert [bench.documents_after_gold(r) for r in rows] == [0, 9, 3, 1]
    assert bench.by_position(rows) == {"0": (1, 1), "1-2": (1, 1), "3-4": (0, 1), "5-9": (1, 1)}
    one, other = tmp_path / "accuracy_real_one.json", tmp_path / "accuracy_real_other.json"
    one.write_text(json.dumps({"rows": {"full": rows}}))
    other.write_text(json.dumps({"rows": {"full": [dict(r, acc=False) for r in rows]}}))
    text = bench.table([one, other])
    assert "| one | other |" in text and "| 5-9 | 1 | 1 | 0 |" in text and text.endswith("| all | 4 | 3 | 0 |")
    other.write_text(json.dumps({"rows": {"full": rows[:3]}}))
    with pytest.raises(SystemExit, match="different questions"):
        bench.table([one, other])


def test_hypic_loss_pairs_compares_two_runs_step_by_step_on_the_same_draws(tmp_path, capsys):
    bench = load_script("bench_hypic_loss_pairs", ROOT / "bench" / "hypic_loss_pairs.py")

    def log(path, hypic):
        lines = [{"stage": 2, "step": 1, "kind": "chat", "tokens": 9, "kl": 0.1}]  # no answer KLs: not a RAG step
        lines += [{"stage": 2, "step": s, "kind": "rag", "tokens": 100 + s, "full_kl_answer": 0.1, "hypic_kl": h}
                  for s, h in zip((2, 3, 4), hypic)]
        path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"torn")
        return path

    before, after = log(tmp_path / "a.jsonl", (0.2, 0.3, 0.4)), log(tmp_path / "b.jsonl", (0.1, 0.2, 0.4))
    assert sorted(bench.rag_steps(before)) == [2, 3, 4]
    m, h, lower = bench.paired([0.2, 0.3, 0.4], [0.1, 0.2, 0.4])
    assert m == pytest.approx(-0.2 / 3) and lower == 2 and h > 0
    bench.main([str(before), str(after)])
    out = capsys.readouterr().out
    assert "3 RAG steps in both (steps 2-4)" in out and "| hypic | 0.3000 | 0.2333 | -0.0667" in out and "| 2/3 |" in out
    bench.main([str(before), str(after), "--skip", "3"])
    assert "1 RAG steps in both (steps 4-4)" in capsys.readouterr().out
    other = tmp_path / "c.jsonl"
    other.write_text(before.read_text().replace('"tokens": 103', '"tokens": 7'))
    with pytest.raises(SystemExit, match="not paired"):
        bench.main([str(before), str(other)])


def test_accuracy_variants_parse_every_lever_and_older_configs_read_as_plain():
    from helpers import ROOT, load_script
    bench = load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")

    assert bench.variant("8/0.15~0.9+p@0.1") == ("hypic s=8 f=0.15 k=0.9 +prefix r=0.1", "hypic", 8, 0.15, True, "0.1", 0.9, "")
    assert bench.variant("8~1.1") == ("hypic s=8 k=1.1", "hypic", 8, 0.0, False, "", 1.1, "")
    assert bench.variant("8~0.9q") == ("hypic s=8 k=0.9 (prompt only)", "hypic", 8, 0.0, False, "", 0.9, "prompt")
    assert bench.variant("16") == ("hypic s=16", "hypic", 16, *bench.PLAIN)
    assert bench.is_plain([]) and bench.is_plain([0.0, False, ""]) and bench.is_plain(list(bench.PLAIN))
    assert not bench.is_plain([0.0, False, "", 0.9]) and not bench.is_plain([0.15, False, ""])
    assert not bench.is_plain([0.0, False, "", 1.0, "prompt"])
    with pytest.raises(SystemExit, match="only"):
        bench.variant("8+q")
    config = bench.lever_config(bench.variant("8/0.15~0.9q+p@0.1")[3:], (1, 2), seam=8)
    assert (config.seam, config.seam_fraction, config.entry_prefix, config.reuse_key_scale, config.reuse_key_scope,
            config.recompute_ratio) == (8, 0.15, (1, 2), 0.9, "prompt", 0.1)
    plain = bench.lever_config(bench.variant("16")[3:], (1, 2), seam=16)
    assert (plain.entry_prefix, plain.reuse_key_scale, plain.reuse_key_scope, plain.recompute_ratio) == ((), 1.0, "all", 0.0)
    assert bench.lever_config(bench.variant("8@gold")[3:], (), seam=8).recompute_ratio == 0.0  # the oracle is install_gold's
    ladder = load_script("bench_ladder_ttft", ROOT / "bench" / "ladder_ttft.py")  # builds its engines the same way
    assert callable(ladder.measure) and ladder.lever_config.__doc__ == bench.lever_config.__doc__


def test_key_scale_scan_pairs_every_scale_with_scale_one():
    from helpers import ROOT, load_script
    bench = load_script("bench_key_scale_scan", ROOT / "bench" / "key_scale_scan.py")

    result = {"model": "m", "set": "short", "n": 3, "seam": 8, "kl": {"1.0": [0.1, 0.2, 0.3], "0.9": [0.05, 0.25, 0.1]},
              "top1": {"1.0": 3, "0.9": 2}}
    lines = bench.table(result)
    assert lines[4].startswith("| 0.9 | 0.1333") and "| -0.0667 (+-" in lines[4] and lines[4].endswith("| 2/3 | 2/3 |")
    assert lines[5].startswith("| 1 | 0.2000") and lines[5].endswith("|  |  | 3/3 |")
    short = list(bench.contexts("short", 2))
    assert len(short) == 2 and all(len(chunks) == 6 for _, chunks in short)


def test_key_scale_scan_plots_saved_scans(tmp_path):
    from helpers import ROOT, load_script
    bench = load_script("bench_key_scale_scan", ROOT / "bench" / "key_scale_scan.py")

    scan = tmp_path / "scan.json"
    scan.write_text(json.dumps({"model": "m", "set": "short", "n": 2, "seam": 8, "kl": {"1.0": [0.1, 0.2], "0.9": [0.05, 0.1]},
                                "top1": {"1.0": 2, "0.9": 2}}))
    bench.plot([scan], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_ladder_report_merges_runs_of_the_same_questions_and_refuses_others(tmp_path):
    report = load_script("bench_ladder_report", ROOT / "bench" / "ladder_report.py")
    full = [{"id": "q1", "answer": "a", "acc": True, "agree": True, "kl": 0.0}, {"id": "q2", "answer": "b", "acc": False, "agree": True, "kl": 0.0}]
    one = {"full": full, "hypic s=8": [dict(r, kl=0.1) for r in full]}
    two = {"full": full, "hypic s=8": [dict(r, kl=0.9) for r in full], "hypic s=8 r=0.1": [dict(r, kl=0.05) for r in full]}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"rows": one}))
    b.write_text(json.dumps({"rows": two}))
    merged = report.merged_rows([str(a), str(b)])
    assert list(merged) == ["full", "hypic s=8", "hypic s=8 r=0.1"]
    assert merged["hypic s=8"][0]["kl"] == 0.1  # the first file's rows of a config both hold
    c.write_text(json.dumps({"rows": {"full": [dict(full[0], answer="other"), full[1]]}}))
    with pytest.raises(SystemExit, match="differ"):
        report.merged_rows([str(a), str(c)])
