"""Ship a reuse-training run's adapter as a named model's files, with its model card.

    python -m training.reuse.ship var/reuse-hybrid models/smollm2-hybrid-135m-reuse ["a note for the card"]

copies `<run>/adapter/` (bf16 LoRA factors, `adapter.json`) into the model's directory and writes
its README.md: what the run was (base, teacher, rank, seam, steps, training time, CPU) and the curve
from `<run>/log.jsonl` (`curve`: mean loss and KLs per block of steps), after the blocks the directory
already held for earlier steps (`curve.json`, kept beside the adapter: a run continued elsewhere from the
shipped adapter logs only its own steps).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

from hypic_core.models.loader import ADAPTER_CARD, ADAPTER_FILE


def read_log(path: Path) -> list[dict]:
    """Every readable line of a run's log.jsonl (a torn last line is skipped); the last record of each step."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def curve(records: list[dict], block: int) -> list[dict]:
    """Mean loss, KL full, KL composed and seconds per step over blocks of `block` steps."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    rows = []
    for i in range(0, len(records), block):
        part = records[i:i + block]
        mean = lambda k: sum(r[k] for r in part) / len(part)  # noqa: E731
        gaps = [r["gap"] for r in part if "gap" in r]  # logged since the consistency term (older steps: none)
        rows.append({"steps": f"{part[0]['step']}-{part[-1]['step']}", "loss": mean("loss"), "kl_full": mean("kl_full"),
                     "kl_composed": mean("kl_composed"), "gap": sum(gaps) / len(gaps) if gaps else None,
                     "seconds": mean("seconds")})
    return rows


def curve_table(rows: list[dict]) -> str:
    lines = ["| steps | loss | KL full | KL composed | composed - full | gap KL(full \\|\\| composed) | s/step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gap = "" if r.get("gap") is None else f"{r['gap']:.4f}"
        lines.append(f"| {r['steps']} | {r['loss']:.4f} | {r['kl_full']:.4f} | {r['kl_composed']:.4f} | "
                     f"{r['kl_composed'] - r['kl_full']:+.4f} | {gap} | {r['seconds']:.0f} |")
    return "\n".join(lines)


CURVE_FILE = "curve.json"


def prior_curve(target: Path) -> list[dict]:
    """The curve rows the model's directory already holds (`curve.json`; else its README's curve table): a
    run continued on another machine from the shipped adapter (`hypic tune --init`) logs only its own steps."""
    path = Path(target) / CURVE_FILE
    if path.is_file():
        return json.loads(path.read_text())
    readme = Path(target) / "README.md"
    rows = []
    if readme.is_file():
        for line in readme.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 7 or "-" not in cells[0] or not cells[0].replace("-", "").isdigit():
                continue
            rows.append({"steps": cells[0], "loss": float(cells[1]), "kl_full": float(cells[2]),
                         "kl_composed": float(cells[3]), "gap": float(cells[5]) if cells[5] else None,
                         "seconds": float(cells[6])})
    return rows


def joined_curve(prior: list[dict], rows: list[dict]) -> list[dict]:
    """`prior`'s blocks that end before `rows`' first step, then `rows`."""
    if not rows:
        return prior
    first = int(rows[0]["steps"].split("-")[0])
    return [r for r in prior if int(r["steps"].split("-")[-1]) < first] + rows


ORDER = ("q", "k", "v", "o", "in", "out")


def targets(adapter: Path) -> str:
    """Which projections an adapter file's factors sit on, in words (from its tensor names)."""
    from safetensors import safe_open

    with safe_open(str(adapter), "pt") as f:
        names = {k.rsplit(".", 1)[0] for k in f.keys()}  # model.layers.3.self_attn.q_proj
    kinds = [("self_attn", "every attention layer's {}"), ("mamba", "every Mamba2 mixer's {}"),
             ("linear_attn", "every Gated DeltaNet mixer's {}")]
    parts = []
    for key, words in kinds:
        projs = sorted({n.rsplit(".", 1)[1].removesuffix("_proj") for n in names if f".{key}." in n},
                       key=lambda p: (ORDER.index(p) if p in ORDER else len(ORDER), p))
        if projs:
            parts.append(words.format(", ".join(projs) + " projections"))
    return " and ".join(parts) or "its projections"


def cpu_name() -> str:
    """The CPU's model name and its wide vector units (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    units = [u for u, f in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_tile")) if f in flags]
    return f"{name} ({', '.join(units)})" if units else name


def ship(run: Path, target: Path, name: str, notes: str = "") -> Path:
    """Copy `run`'s adapter into `target` and write its README.md (see the module docstring)."""
    run, target = Path(run), Path(target)
    src = run / "adapter"
    if not (src / ADAPTER_FILE).is_file():
        raise FileNotFoundError(f"{src}: no {ADAPTER_FILE}; the run has not written a checkpoint yet")
    card = json.loads((src / ADAPTER_CARD).read_text())
    records = [r for r in read_log(run / "log.jsonl") if r["step"] <= card["step"]]
    target.mkdir(parents=True, exist_ok=True)
    rows = joined_curve(prior_curve(target), curve(records, max(1, len(records) // 12)))  # no records: no rows
    for f in (ADAPTER_FILE, ADAPTER_CARD):
        tmp = target / (f + ".tmp")
        shutil.copyfile(src / f, tmp)
        tmp.chmod(0o644)
        tmp.replace(target / f)
    (target / CURVE_FILE).write_text(json.dumps(rows, indent=1))
    hours = card["train_seconds"] / 3600
    teacher = f" --teacher {card['teacher']}" if card.get("teacher") else ""
    hinge = (f" + a * the agreement hinge (a = {card['agreement']}, margin {card['margin']} logits)"
             if card.get("agreement") else "")
    agreement = f" --agreement {card['agreement']} --margin {card['margin']}" if card.get("agreement") else ""
    full = card.get("method", "lora") == "full"
    method = ("full fine-tuning of every decoder-layer parameter (a delta per parameter)" if full
              else f"LoRA (rank {card['rank']}) on {targets(target / ADAPTER_FILE)}")
    how = "--method full" if full else f"--rank {card['rank']}"
    if card.get("link"):  # the third rung: link tokens after every document, served with the model
        method += (f", and the link `{card['link']}` written after every document and recomputed in every request "
                   f"(those tokens' embedding rows trained; served with the model)")
        how += f" --link '{card['link']}'"
    text = f"""# {name}

`{card['base']}` with a reuse adapter: {method}, trained so that `hypic` reuse (documents computed alone,
seam {card['seam']}) keeps the answer `full` prefill gives. Served by name (`hypic serve --model {name}`):
the base is built as usual and the tensors in `{ADAPTER_FILE}` (bf16) are merged into its weights once
(hypic_core/models/loader.py `write_adapted`), so the served checkpoint keeps the base's layout.

Recipe (docs/training.md, "Reuse-aware training"): each step one RAG prompt laid out as /query lays it
out (3-8 documents in a random order: the teacher's shipped RAG samples with distractor passages, and
templated questions over the docstring corpus's training split), run through the student in `full` and
composed as the engine serves `hypic`; loss on the reply = KL(teacher full || student composed) +
KL(teacher full || student full) + c * KL(student full || student composed){hinge} (c = {card.get('consistency', 0)} when this
checkpoint was written; the span: {'the student' + "'" + 's own greedy full reply' if card.get('reply') == 'student' else "the sample's reply"});
teacher `{card['teacher'] or 'the base itself'}`; AdamW lr {card['lr']}, {card['precision']}.

This checkpoint: step {card['step']}, {hours:.2f} h of training on one thread of an {cpu_name()}
(2 cores shared with other jobs the whole time, so seconds per step are not a speed measurement).
{notes + chr(10) if notes else ""}
Curve (`{run.name}/log.jsonl`, and `{CURVE_FILE}` here for steps logged on an earlier machine; mean per block of
steps; one sample per step, so single blocks are noisy):

{curve_table(rows)}

Reproduce: `hypic tune --model {card['base']}{teacher} --data {card.get('data', 'distill')} {how} --lr {card['lr']} --consistency {card.get('consistency', 0)}{agreement} --reply {card.get('reply', 'sample')} --out var/{run.name} --minutes N`
(a rerun resumes; on a machine without that folder add `--init models/{name}` to continue this adapter), then
`python -m training.reuse.ship var/{run.name} models/{name}`.
"""
    (target / "README.md").write_text(text)
    return target


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        raise SystemExit("usage: python -m training.reuse.ship RUN_DIR MODEL_DIR [NOTE]  (NOTE: a paragraph for the model card)")
    run, target = Path(argv[0]), Path(argv[1])
    print(ship(run, target, target.name, argv[2] if len(argv) == 3 else ""))


if __name__ == "__main__":
    main()
