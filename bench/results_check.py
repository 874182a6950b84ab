"""docs/results.md, the project's headline numbers, each once, read from the result files in bench/results/.

    .venv/bin/python bench/results_check.py            # (re)writes docs/results.md and README.md's headline block
    .venv/bin/python bench/results_check.py --check    # exits 1 when either differs from the result files

Each headline names the JSON file its number comes from, the command that wrote that file, the
date of the run and the machine. The number is read from the file every time, never typed, so the
page cannot drift from the measurement; README.md's headline block (between
`<!-- headlines:begin -->` and `<!-- headlines:end -->`) is written from the same numbers, and
tests/test_results_doc.py fails when either page is stale. A new measurement: write its JSON into
bench/results/, point a `Headline` at it (or at the new file), run this script.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- headlines:begin -->", "<!-- headlines:end -->"
# The CPU of the earlier runs is not in their files: this project's machines have been 2-core AMD EPYCs
# (AVX2 or AVX-512) and, since 2026-12-07, an Intel Xeon (Sapphire Rapids class). first_serve.json records its own.
CPU = "the project's 2-core CPU machine (model not recorded in the file)"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def answered(rows: list[dict]) -> int:
    """Questions answered right (bench/accuracy_real.py's `acc`) in one config's rows."""
    return sum(1 for row in rows if row["acc"])


@dataclass(frozen=True)
class Headline:
    key: str                       # a stable name, used by the README block
    what: str                      # what is measured, in words
    source: str                    # the JSON file in bench/results/
    value: Callable[[dict], str]   # the number, read from the file
    command: str
    date: str
    machine: str

    def number(self) -> str:
        return self.value(load(self.source))


def _ratio(model: str, config: str) -> Callable[[dict], str]:
    return lambda d: f"{d[model][config]['full_over']:.1f}x ({d[model]['full']['ms'] / 1000:.1f} s -> {d[model][config]['ms'] / 1000:.2f} s)"


def _answers(config: str) -> Callable[[dict], str]:
    return lambda d: f"{answered(d['rows'][config])}/{len(d['rows'][config])}"


def _identical(d: dict, config: str = "hypic:8") -> str:
    """bench/faithfulness.py's share of answers identical to `full`'s, with its Wilson 95% interval."""
    from stats import identical_share

    n, share = identical_share(d["rows"], config)
    return f"{100 * share.mean:.1f}% of {n} ({100 * share.low:.1f}-{100 * share.high:.1f})"


def _rates(d: dict) -> str:
    rate = d["sustainable_rate"]
    return f"{rate['hypic']} req/s hypic, {rate['full']} req/s full"


def _first_serve(d: dict) -> str:
    env = "".join(f", {k}={v}" for k, v in d["env"].items())
    return f"ready {d['ready_s']:.0f} s, first answer {d['first_answer_s']:.0f} s (load {d['load_before'][0]:.1f}{env})"


LADDER = (".venv/bin/python bench/ladder_ttft.py --configs 8 8+p 8~0.9q 8~0.9q+p 8@0.05 8@0.1 --reps 3 --threads 1 "
          "--json bench/results/ladder_ttft_84.json")
QUIET = f"{CPU}, 1 torch thread, quiet machine"

HEADLINES: tuple[Headline, ...] = (
    Headline("warm-hybrid", "Warm TTFT, `full` / `hypic` (seam 8), smollm2-hybrid-135m, 6 chunks x 300 tokens, engine only",
             "ladder_ttft_84.json", _ratio("smollm2-hybrid-135m", "hypic s=8"), LADDER, "2026-12-06", QUIET),
    Headline("warm-dense", "Warm TTFT, `full` / `hypic` (seam 8), smollm2-135m-instruct (dense), same workload",
             "ladder_ttft_84.json", _ratio("smollm2-135m-instruct", "hypic s=8"), LADDER, "2026-12-06", QUIET),
    Headline("answers-hybrid-full", "84 real questions (data/real_qa) answered right, smollm2-hybrid-135m (untuned), `full`",
             "accuracy_real_smollm2-hybrid-135m_zero_cost.json", _answers("full"),
             ".venv/bin/python bench/accuracy_real.py --model smollm2-hybrid-135m --n 84 --seams --naive-seams --no-prefix "
             "--variants 8+p 8~0.9q 8~0.9q+p --raw accuracy_real_smollm2-hybrid-135m_zero_cost.json "
             "--merge bench/results/accuracy_real_smollm2-hybrid-135m_r12.json 'hypic s=8' --max-tokens 32",
             "2026-12-06", f"{CPU}, 2 processes"),
    Headline("answers-hybrid-hypic", "The same 84 questions, smollm2-hybrid-135m, `hypic` seam 8 (the default seam)",
             "accuracy_real_smollm2-hybrid-135m_zero_cost.json", _answers("hypic s=8"), "the same run", "2026-12-06",
             f"{CPU}, 2 processes"),
    Headline("answers-dense-full", "The same 84 questions, smollm2-135m-instruct (the hybrid's dense teacher), `full`",
             "accuracy_real_smollm2-135m-instruct_zero_cost.json", _answers("full"),
             ".venv/bin/python bench/accuracy_real.py --model smollm2-135m-instruct --n 84 --seams --naive-seams --no-prefix "
             "--variants 8+p 8~0.9q 8~0.9q+p --raw accuracy_real_smollm2-135m-instruct_zero_cost.json "
             "--merge bench/results/accuracy_real_smollm2-135m-instruct_84_s8.json 'hypic s=8' --max-tokens 32",
             "2026-12-06", f"{CPU}, 2 processes"),
    Headline("answers-dense-hypic", "The same 84 questions, smollm2-135m-instruct, `hypic` seam 8",
             "accuracy_real_smollm2-135m-instruct_zero_cost.json", _answers("hypic s=8"), "the same run", "2026-12-06",
             f"{CPU}, 2 processes"),
    Headline("answers-reuse-full", "The same 84 questions, smollm2-hybrid-135m-reuse (the default: the hybrid tuned for reuse, step 1139), `full`",
             "accuracy_real_smollm2-hybrid-135m-reuse.json", _answers("full"),
             ".venv/bin/python bench/accuracy_real.py --model smollm2-hybrid-135m-reuse --n 84 --seams 8 --naive-seams --no-prefix "
             "--threads 1 --no-write --save bench/results/accuracy_real_smollm2-hybrid-135m-reuse.json", "2026-12-07",
             "Intel Xeon (Sapphire Rapids class), 1 torch thread, beside other jobs"),
    Headline("answers-reuse-hypic", "The same 84 questions, smollm2-hybrid-135m-reuse, `hypic` seam 8",
             "accuracy_real_smollm2-hybrid-135m-reuse.json", _answers("hypic s=8"), "the same run", "2026-12-07",
             "Intel Xeon (Sapphire Rapids class), 1 torch thread, beside other jobs"),
    Headline("faithful-hybrid", "Held-out RAG prompts whose 32-token `hypic` answer is `full`'s word for word (Wilson 95%), "
             "smollm2-hybrid-135m (untuned)", "faithfulness_smollm2-hybrid-135m.json", _identical,
             ".venv/bin/python bench/faithfulness.py --model smollm2-hybrid-135m --forced --max-minutes 23 "
             "--save bench/results/faithfulness_smollm2-hybrid-135m.json", "2026-12-07",
             "Intel Xeon (Sapphire Rapids class), 1 torch thread, beside other jobs"),
    Headline("faithful-reuse", "The same measure, smollm2-hybrid-135m-reuse (step 1139)",
             "faithfulness_smollm2-hybrid-135m-reuse.json", _identical,
             ".venv/bin/python bench/faithfulness.py --model smollm2-hybrid-135m-reuse --n 85 --forced --max-minutes 30 "
             "--threads 1 --save bench/results/faithfulness_smollm2-hybrid-135m-reuse.json "
             "--card models/smollm2-hybrid-135m-reuse/faithfulness.json", "2026-12-07",
             "Intel Xeon (Sapphire Rapids class), 1 torch thread, beside other jobs"),
    Headline("serving-rate", "Sustainable rate (p95 TTFT <= 10 s), Poisson arrivals, 31M-parameter bench hybrid, 10 x 512-token chunks",
             "serve_results.json", _rates,
             ".venv/bin/python bench/serve.py --model /tmp/bench-model --corpus-size 1000 --rates 0.05 0.1 0.2 0.4 0.8 1.6 "
             "--num-requests 20 --duration 200 --warmup 30 --slo-ttft-ms 10000 --decode-scaling --cold-arrival "
             "--out bench/results/serve_results.json --plot docs/serve_ttft_vs_rate.png --markdown",
             "2026-12-02", f"{CPU}, 1 torch thread"),
    Headline("first-serve", "A newcomer's first serve: `scripts/serve` (installed, empty index) to /ready and to the "
             "first README question answered in `hypic` mode",
             "first_serve.json", _first_serve, ".venv/bin/python bench/first_serve.py --json bench/results/first_serve.json "
             "--env HYPIC_TORCH_THREADS=1", "see the file", "Intel Xeon (Sapphire Rapids class, AVX-512, AMX), 2 cores, shared with other jobs (load in the number)"),
)


def render_page() -> str:
    lines = [
        "# Results",
        "",
        "The project's headline numbers, each once. Generated by `.venv/bin/python bench/results_check.py` from",
        "the result files in `bench/results/`; do not edit by hand (tests/test_results_doc.py fails when this page",
        "or README.md's numbers differ from the files). Everything else measured, with its history:",
        "[benchmarks.md](benchmarks.md), [accuracy.md](accuracy.md), and the answers' faithfulness to the documents:",
        "[results_faithfulness.md](results_faithfulness.md).",
        "",
        "| what | number | command | date | machine | file |",
        "|---|---|---|---|---|---|",
    ]
    for h in HEADLINES:
        command = f"`{h.command}`" if h.command.startswith(".venv") else h.command
        lines.append(f"| {h.what} | **{h.number()}** | {command} | {_date(h)} | {h.machine} | "
                     f"[{h.source}](../bench/results/{h.source}) |")
    return "\n".join(lines) + "\n"


def _date(h: Headline) -> str:
    return load(h.source).get("date", h.date) if h.date == "see the file" else h.date


def render_readme_block() -> str:
    n = {h.key: h.number() for h in HEADLINES}
    return "\n".join([
        BEGIN,
        f"- Warm `hypic` reaches the first token {n['warm-hybrid'].split(' ')[0]} sooner than `full` on smollm2-hybrid-135m "
        f"({n['warm-dense'].split(' ')[0]} on its dense teacher), six 300-token chunks, one CPU thread.",
        f"- Answers on 84 real questions, the default model (`smollm2-hybrid-135m-reuse`, the hybrid tuned for reuse): "
        f"{n['answers-reuse-full']} with `full`, {n['answers-reuse-hypic']} with `hypic`; its `hypic` answer is `full`'s "
        f"word for word on {n['faithful-reuse'].split(' (')[0]} held-out prompts (untuned: "
        f"{n['faithful-hybrid'].split(' (')[0]}) ([accuracy](docs/accuracy.md)).",
        f"- The untuned hybrid (`smollm2-hybrid-135m`): {n['answers-hybrid-full']} with `full`, {n['answers-hybrid-hypic']} "
        f"with `hypic` (its dense teacher: {n['answers-dense-full']} and {n['answers-dense-hypic']}); reuse costs it answers.",
        f"- Serving a 31M bench hybrid on 2 cores: {n['serving-rate']} within a 10 s p95 TTFT.",
        f"- First serve (`scripts/serve` with an empty index to `/ready`, then the first question above in `hypic`): "
        f"{n['first-serve']}.",
        "",
        "Each number, its command, date and machine: [docs/results.md](docs/results.md).",
        END,
    ])


def readme_with_block(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return text[: text.index(BEGIN)] + render_readme_block() + text[text.index(END) + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/results.md or README.md's block is stale")
    args = ap.parse_args(argv)
    page = render_page()
    readme = readme_with_block(README.read_text(encoding="utf-8"))
    if args.check:
        stale = [str(p.relative_to(ROOT)) for p, text in ((PAGE, page), (README, readme))
                 if not p.is_file() or p.read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{name} is stale: run .venv/bin/python bench/results_check.py", file=sys.stderr)
        return 1 if stale else 0
    PAGE.write_text(page, encoding="utf-8")
    README.write_text(readme, encoding="utf-8")
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
