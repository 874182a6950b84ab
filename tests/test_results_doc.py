"""docs/results.md and README.md's headline numbers are read from bench/results/, never typed; result
files live in bench/results/, and docs/ keeps only the figures its pages show."""

from __future__ import annotations

import re

from helpers import ROOT, load_script

results_check = load_script("results_check", ROOT / "bench" / "results_check.py")


def test_results_page_and_readme_numbers_match_the_result_files():
    assert results_check.main(["--check"]) == 0, "run .venv/bin/python bench/results_check.py"


def test_every_headline_reads_its_number_from_an_existing_file_once():
    keys = [h.key for h in results_check.HEADLINES]
    assert len(keys) == len(set(keys))
    page = results_check.render_page()
    for headline in results_check.HEADLINES:
        assert (results_check.RESULTS / headline.source).is_file(), headline.source
        number = headline.number()
        assert re.search(r"\d", number), (headline.key, number)
        assert page.count(f"**{number}**") >= 1
    assert "results_faithfulness.md" in page


def test_a_changed_number_is_caught():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = results_check.render_readme_block()
    assert block in readme
    tampered = readme.replace(block, re.sub(r"\d+\.\dx", "99.9x", block, count=1))
    assert tampered != readme
    assert results_check.readme_with_block(tampered) == readme  # the script writes the measured number back


def test_answers_are_counted_from_the_rows():
    rows = [{"acc": True}, {"acc": False}, {"acc": True}]
    assert results_check.answered(rows) == 2
    assert results_check._answers("x")({"rows": {"x": rows}}) == "2/3"


def test_docs_keep_no_result_files_but_the_figures_they_show():
    docs = ROOT / "docs"
    assert not list(docs.glob("*.json")), "result files belong in bench/results/"
    pages = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *docs.glob("*.md"), *docs.glob("history/*.md"),
                                                                 *(ROOT / "models").glob("*/README.md")])
    unshown = [p.name for p in docs.glob("*.png") if p.name not in pages]
    assert not unshown, unshown


def test_result_files_named_in_the_docs_exist():
    named = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("history/*.md")]:
        named |= set(re.findall(r"bench/results/([\w.\-]+\.(?:jsonl|json|png|md)\b)", page.read_text(encoding="utf-8")))
    missing = sorted(n for n in named if not (ROOT / "bench" / "results" / n).is_file() and n != "accuracy_bundled.md")
    assert not missing, missing
