"""bench/faithfulness.py and bench/stats.py: the paired statistics against known values and their plain twins,
the prompts' make-up, and a run on hypic-tiny whose arithmetic is known (a seam over every document is
`full`, so every answer is identical; the reused answer decoded equals the one read from forced logits)."""

from __future__ import annotations

import json
import math
from itertools import product

import pytest

from conftest import ROOT, load_script

stats = load_script("bench_stats", ROOT / "bench" / "stats.py")
faith = load_script("bench_faithfulness", ROOT / "bench" / "faithfulness.py")


# --- bench/stats.py ---------------------------------------------------------------------------
def _mcnemar_by_enumeration(lost: int, gained: int) -> float:
    """Every way n fair coins fall, summed where the outcome is at least as lopsided as the one seen."""
    n = lost + gained
    seen = abs(lost - gained)
    extreme = sum(abs(2 * sum(flips) - n) >= seen for flips in product((0, 1), repeat=n))
    return min(1.0, extreme / 2 ** n)


def test_mcnemar_exact_known_values_and_the_enumeration():
    assert stats.mcnemar_exact(4, 0) == 0.125
    assert stats.mcnemar_exact(8, 0) == pytest.approx(0.0078125)
    assert stats.mcnemar_exact(0, 0) == 1.0 and stats.mcnemar_exact(3, 3) == 1.0
    assert stats.mcnemar_exact(12, 5) == stats.mcnemar_exact(5, 12) == pytest.approx(0.1435, abs=1e-4)
    for lost, gained in [(1, 0), (2, 5), (9, 1), (6, 6), (0, 11)]:
        assert stats.mcnemar_exact(lost, gained) == pytest.approx(_mcnemar_by_enumeration(lost, gained))
    with pytest.raises(ValueError, match="lost=-1"):
        stats.mcnemar_exact(-1, 2)


def test_paired_bootstrap_matches_its_plain_twin_and_brackets_the_mean():
    a = [0.1 * (i % 7) for i in range(60)]
    b = [0.05 * (i % 5) for i in range(60)]
    for args in ((a,), (a, b)):
        fast, plain = stats.paired_bootstrap_ci(*args, resamples=500, seed=3), stats.paired_bootstrap_ci_reference(*args, resamples=500, seed=3)
        assert fast.mean == pytest.approx(plain.mean) and fast.low == pytest.approx(plain.low) and fast.high == pytest.approx(plain.high)
        assert fast.low < fast.mean < fast.high
    assert stats.paired_bootstrap_ci(a, b).mean == pytest.approx(sum(a) / 60 - sum(b) / 60)
    assert stats.paired_bootstrap_ci([1.0] * 9) == (1.0, 1.0, 1.0)  # no spread, no interval
    for bad, match in [(([],), "no values"), (([1.0], [1.0, 2.0]), "unequal length")]:
        with pytest.raises(ValueError, match=match):
            stats.paired_bootstrap_ci(*bad)
    w = stats.wilson_interval(19, 20)
    assert w.low < 0.95 < w.high and w.high < 1.0 and stats.wilson_interval(20, 20).high == 1.0
    rows = [{"hypic:8": {"identical": i < 3}} for i in range(8)] + [{"other": {"identical": True}}]
    assert stats.identical_share(rows) == (8, stats.wilson_interval(3, 8))  # the row without the config is left out
    with pytest.raises(ValueError, match="no rows of 'full'"):
        stats.identical_share(rows, "full")


# --- the prompts ------------------------------------------------------------------------------
def test_the_shipped_documents_and_the_prompts_built_from_them():
    docs = faith.load_docs()
    sources = {d.source for d in docs}
    assert sources == {"docstrings", "debian"} and all(d.licence and d.text for d in docs)
    from training.reuse.data import heldout_documents, training_documents

    held = "\n\n".join(t for _, t in heldout_documents())
    trained = "\n\n".join(t for _, t in training_documents())
    # Every docstring unit is text reuse training never sees. The corpus is read from the running
    # interpreter's standard library, whose docstrings change a little between patch releases (the
    # set was cut on 3.11.7): no unit may be in the training split on any interpreter, and nearly all
    # are found in the held-out one.
    units = [d for d in docs if d.source == "docstrings"]
    found = 0
    for d in units:
        first = d.text.split("\n\n")[0]
        assert first not in trained, d.where
        found += first in held
    assert found >= 0.9 * len(units), f"only {found} of {len(units)} docstring units found in the held-out split"
    prompts = faith.build_prompts(docs, 40, seed=0, pool=30)
    assert prompts == faith.build_prompts(docs, 40, seed=0, pool=30)  # a seed gives the same prompts
    assert [(p.source, p.length) for p in prompts[:4]] == faith.CLASSES
    by_id = {d.id: d for d in docs}
    for p in prompts:
        assert 3 <= len(p.doc_ids) <= 8 and len(set(p.doc_ids)) == len(p.doc_ids) and "{" not in p.question
        assert all(by_id[i].source == p.source for i in p.doc_ids)
        assert all(len(t.split()) <= faith.LENGTHS[p.length] for t in p.documents)
        if p.length == "long":
            assert all(len(t.split()) >= 0.66 * faith.LENGTHS["long"] for t in p.documents)
    assert faith.build_prompts(docs, 40, seed=1, pool=30) != prompts
    with pytest.raises(ValueError, match="fewer than 8"):
        faith.build_prompts(docs, 4, pool=5)


def test_answer_comparison_helpers():
    import torch

    assert faith.first_difference([1, 2, 3], [1, 2, 3]) == 3 and faith.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert faith.first_difference([1, 2], [1, 2, 3]) == 2
    cont = torch.nn.functional.one_hot(torch.tensor([4, 7, 9]), 10).float()
    assert faith.forced_match(cont, [4, 7, 9]) == 3 and faith.forced_match(cont, [4, 6, 9]) == 1
    assert faith.parse_config("pic-naive:0") == ("pic-naive", 0)
    with pytest.raises(SystemExit, match="MODE:SEAM"):
        faith.parse_config("hypic")


# --- a run on hypic-tiny ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from app.testing import single_torch_thread

    out = tmp_path_factory.mktemp("faith") / "tiny.json"
    args = faith.parser().parse_args(["--model", "hypic-tiny", "--n", "6", "--pool", "10", "--words", "10", "25",
                                      "--max-tokens", "8", "--configs", "hypic:100000", "pic-naive:0", "--save", str(out)])
    with single_torch_thread():
        results = faith.run(args)
    return results


def test_a_seam_over_every_document_is_identical_to_full(tiny_run):
    s = faith.summary(tiny_run, "hypic:100000")
    assert s["n"] == 6 and s["identical"] == (1.0, 1.0, 1.0) and s["kl_first"].mean < 1e-5 and s["kl_answer"].mean < 1e-5
    for row in tiny_run["rows"]:
        assert row["hypic:100000"]["matched"] == row["full"]["tokens"] and row["hypic:100000"]["answer"] == row["full"]["answer"]


def test_decoded_answers_agree_with_the_forced_reading_and_the_table_adds_up(tiny_run):
    for row in tiny_run["rows"]:
        for config in tiny_run["configs"]:
            r = row[config]
            assert r["matched"] == r["forced_matched"]  # greedy decoding follows full while each argmax does
            assert r["identical"] == (r["matched"] == row["full"]["tokens"] and r["answer"] == row["full"]["answer"])
    s = faith.summary(tiny_run, "pic-naive:0")
    share = sum(r["pic-naive:0"]["identical"] for r in tiny_run["rows"]) / 6
    assert s["identical"].mean == pytest.approx(share) and s["identical"].low <= share <= s["identical"].high
    assert s["kl_answer"].low <= s["kl_answer"].mean <= s["kl_answer"].high
    lines = faith.table([tiny_run, tiny_run])
    assert any(line.startswith("| hypic-tiny | pic-naive:0 | 6 |") for line in lines)
    assert "| hypic-tiny | hypic:100000 | 6 | 0 / 0 | 1 |" in "\n".join(lines)  # a run against itself: nothing lost


def test_a_saved_run_is_reported_under_its_label(tiny_run, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny_run))
    plain, named = faith.labelled(str(path)), faith.labelled(f"tuned (step 7)={path}")
    assert "label" not in plain and named["label"] == "tuned (step 7)" and named["rows"] == plain["rows"]
    text = "\n".join(faith.table([plain, named]))
    assert "| tuned (step 7) | pic-naive:0 | 6 |" in text and "| hypic-tiny | pic-naive:0 | 6 |" in text
    assert "| tuned (step 7) | hypic:100000 | 6 | 0 / 0 | 1 |" in text  # the pair's row carries the label too


def test_the_release_card_reads_back_as_the_guard_reads_it(tiny_run, tmp_path):
    from app.service.guard import load_release

    card = tmp_path / "faithfulness.json"
    faith.write_card(tiny_run, card, "--model hypic-tiny")
    release = load_release(card)
    assert release.config == "hypic:100000" and release.n == 6 and release.answer_tokens == 8
    assert release.identical == 1.0 and release.low < 1.0 == release.high
    assert json.loads(card.read_text())["command"].startswith(".venv/bin/python bench/faithfulness.py")
    assert math.isfinite(json.loads(card.read_text())["kl_answer"])


def test_the_accuracy_reports_give_the_exact_mcnemar_p_beside_lost_and_gained():
    accuracy = load_script("bench_accuracy_real", ROOT / "bench" / "accuracy_real.py")
    ladder = load_script("bench_ladder_report", ROOT / "bench" / "ladder_report.py")

    def row(acc):
        return {"id": "q", "answer": "a", "acc": acc, "f1": 1.0, "agree": True, "kl": 0.0, "cont_kl": 0.0, "top1": True, "ws": False}

    full = [row(True)] * 8 + [row(False)] * 2
    reused = [row(False)] * 8 + [row(False)] * 2  # the 8 full answered, lost; none gained
    results = {"configs": [["full", "full", 0], ["hypic s=8", "hypic", 8]], "rows": {"full": full, "hypic s=8": reused}}
    [line] = [x for x in accuracy.table(results) if x.startswith("| hypic s=8 | 8 | 0 |")]
    assert line.startswith("| hypic s=8 | 8 | 0 | 0.00781 |")
    [line] = [x for x in ladder.summary({"m": {"full": full, "hypic s=8": reused}}, {}, "hypic s=8") if "| 8 / 0 |" in x]
    assert "| 8 / 0 | 0.00781 |" in line


def test_shares_of_a_run_join_in_prompt_order(tiny_run):
    a = dict(tiny_run, rows=tiny_run["rows"][:2], n=2, first=0, seconds=5)
    b = dict(tiny_run, rows=tiny_run["rows"][2:], n=4, first=2, seconds=7)
    joined = faith.join([b, a])
    assert joined["rows"] == tiny_run["rows"] and (joined["n"], joined["seconds"], joined["processes"]) == (6, 7, 2)
    with pytest.raises(SystemExit, match="tile"):
        faith.join([a, dict(b, first=3)])
    with pytest.raises(SystemExit, match="different runs"):
        faith.join([a, dict(b, seed=1)])


def test_the_reuse_curve_reads_each_checkpoints_saved_runs(tmp_path):
    curve = load_script("bench_reuse_curve", ROOT / "bench" / "reuse_curve.py")
    faith = {"rows": [{"hypic:8": {"identical": i < 3}} for i in range(8)]}
    acc = {"rows": {"full": [{"id": f"q{i}", "acc": i < 5, "answer": f"a{i}"} for i in range(10)],
                    "hypic s=8": [{"id": f"q{i}", "acc": i < 4, "answer": f"a{i}" if i % 2 else "other"} for i in range(10)]}}
    (tmp_path / "f.json").write_text(json.dumps(faith))
    (tmp_path / "a.json").write_text(json.dumps(acc))
    p = curve.point(f"120={tmp_path / 'f.json'},{tmp_path / 'a.json'}")
    share = stats.wilson_interval(3, 8)
    assert (p["step"], p["n"], p["identical"], p["low"], p["high"]) == (120, 8, share.mean, share.low, share.high)
    assert (p["full_correct"], p["hypic_correct"], p["questions"], p["same_answer"]) == (5, 4, 10, 0.5)
    assert "questions" not in curve.point(f"0={tmp_path / 'f.json'}")
    with pytest.raises(ValueError, match="STEP=FAITHFULNESS_JSON"):
        curve.point(str(tmp_path / "f.json"))
    curve.plot([p, curve.point(f"0={tmp_path / 'f.json'}")], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
