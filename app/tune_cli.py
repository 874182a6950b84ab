"""`hypic tune`: train a reuse adapter (LoRA) for a served model, in the background, resumable.

The app layer's part of reuse training (training/reuse does the training): it builds each prompt
exactly as /query lays it out for the model (app/service/prompter.py `Prompter.query`, the model's
prompt settings) and picks the documents: `--data index` the chunks the user ingested (the
gateway's index, `HYPIC_INDEX_DIR`; cut into passages of 30-90 words, so several fit a prompt), `--data docstrings` the docstring corpus's training split,
`--data distill` the shipped teacher RAG samples (data/distill) mixed with the docstring corpus
(how `smollm2-hybrid-135m-reuse` is trained). A rerun with the same `--out` resumes.

    hypic tune --model smollm2-135m-instruct --out var/tune-smollm2 --minutes 60
    hypic tune --model smollm2-hybrid-135m --teacher smollm2-135m-instruct --data distill --out var/reuse-hybrid --minutes 120

The adapter is written to `<out>/adapter` (and refreshed at every checkpoint); serve it with
`hypic serve --model '<model>+<out>/adapter'` (docs/training.md). `--evaluate N` measures the
checkpoint instead of training (mean KLs with and without the adapter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Sequence

import typer

DATA = ("index", "docstrings", "distill")


def gateway_layout(model_name: str, tokenizer, prompt: dict[str, str] | None = None, context: int = 8192):
    """A `training.reuse.data.LayoutFn`: (question, documents) -> the /query layout for the model
    (`prompt`: the resolved model's prompt settings, `ResolvedModel.prompt`; the generic ones where unset)."""
    from app.service.prompter import Prompter
    from app.service.settings import Settings
    from retrieval.document import Chunk, chunk_id_for
    from retrieval.index import SearchHit
    from training.reuse.data import Layout

    layout = Settings(_env_file=None, model=model_name).prompt_layout(tokenizer, prompt)
    prompter = Prompter(tokenizer, layout, context)

    def build(question: str, docs: Sequence[str]) -> Layout:
        hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "tune", 0, t, 0)) for i, t in enumerate(docs)]
        prompt = prompter.query(question, hits, reserve=64)
        if prompt.dropped:
            raise ValueError(f"{prompt.dropped} of {len(docs)} documents did not fit the context of {context} tokens")
        return Layout(tuple(tuple(s) for s in prompt.segments), prompt.exact_prefix)

    return build


def index_texts(index_dir: Path, configured: str = "minilm") -> list[str]:
    """Every chunk's text in the gateway's index at `index_dir` (what the user ingested), opened
    with the embedder it was built with: the one its manifest names, else the gateway's `configured`
    one (HYPIC_EMBEDDER: a model directory's manifest holds only the directory's name)."""
    from retrieval.embedder import load_embedder
    from retrieval.errors import RetrievalError
    from retrieval.index import MANIFEST_NAME, Manifest, VectorIndex

    if not (Path(index_dir) / MANIFEST_NAME).is_file():
        raise typer.BadParameter(f"{index_dir} is not an index (no {MANIFEST_NAME}); ingest documents first (hypic ingest)",
                                 param_hint="--index-dir")
    recorded = Manifest.read(Path(index_dir) / MANIFEST_NAME).embedder
    try:
        try:
            embedder = load_embedder(recorded)
        except RetrievalError:
            embedder = load_embedder(configured)
        index = VectorIndex(index_dir, embedder)
    except RetrievalError as exc:
        raise typer.BadParameter(f"cannot open the index at {index_dir} (built with embedder {recorded!r}): {exc}",
                                 param_hint="--index-dir") from exc
    texts = [c.text for d in index.list_documents() for c in index.chunks(d.document_id)]
    if not texts:
        raise typer.BadParameter(f"the index at {index_dir} holds no documents; ingest some first (hypic ingest)", param_hint="--index-dir")
    return texts


def tune_command(
    out: Annotated[Path, typer.Option(help="Run directory: checkpoint, log.jsonl, adapter/ (a rerun resumes).")],
    model: Annotated[str | None, typer.Option(help="The served model to tune (default: HYPIC_MODEL).")] = None,
    teacher: Annotated[str | None, typer.Option(help="Teacher model (same tokenizer); default: the model's own full mode.")] = None,
    data: Annotated[str, typer.Option(help=f"Where prompts come from: {', '.join(DATA)}.")] = "index",
    index_dir: Annotated[Path | None, typer.Option(help="The index for --data index (default: HYPIC_INDEX_DIR).")] = None,
    minutes: Annotated[float, typer.Option(help="Training time of this run (a rerun continues).")] = 30.0,
    steps: Annotated[int, typer.Option(help="Stop at this many steps in all.")] = 1_000_000,
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 16,
    method: Annotated[str, typer.Option(help="lora (low-rank corrections to the attention and mixer projections) or "
                                             "full (every decoder-layer parameter; a lower --lr, e.g. 1e-5).")] = "lora",
    seam: Annotated[int | None, typer.Option(help="Seam trained for (default: HYPIC_SEAM).")] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW).")] = 1e-4,
    save_minutes: Annotated[float, typer.Option(help="Minutes between checkpoints.")] = 5.0,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
    precision: Annotated[str, typer.Option(help="fp32, or bf16 autocast for the forwards.")] = "fp32",
    seed: Annotated[int, typer.Option(help="Data and adapter seed.")] = 0,
    consistency: Annotated[float, typer.Option(help="Weight of KL(student full || student composed), full held fixed: "
                                                    "composed pulled towards the student's own full answer.")] = 10.0,
    agreement: Annotated[float, typer.Option(help="Weight of the agreement hinge: composed asked to prefer full's greedy "
                                                  "token by --margin logits at every answer position (0: off).")] = 0.0,
    margin: Annotated[float, typer.Option(help="The agreement hinge's margin, in logits.")] = 1.0,
    reply: Annotated[str, typer.Option(help="The answer span trained on: student (its own greedy full answer, what "
                                            "the gateway compares with) or sample (the sample's, else the teacher's).")] = "student",
    link: Annotated[str, typer.Option(help="Train link tokens too (the ladder's third rung): these special tokens "
                                            "(unused ones, e.g. '<jupyter_start><jupyter_text><jupyter_code><jupyter_output>') "
                                            "after every document, recomputed in every request; their embedding rows "
                                            "are trained and the adapter serves them.")] = "",
    init: Annotated[Path | None, typer.Option(help="With no checkpoint in --out: continue this exported adapter "
                                              "(its factors, step and data cursor; e.g. a shipped models/<name>/), "
                                              "so a run goes on on another machine.")] = None,
    evaluate: Annotated[int, typer.Option(help="Instead of training: the mean KLs of this many prompts with the "
                                               "checkpoint's adapter and without it, into <out>/evaluation.json "
                                               "(held-out docstring documents; with --data index, the index's).")] = 0,
) -> None:
    """Train a reuse adapter by self-distillation: KL(teacher full || composed) + KL(teacher full || full)
    + consistency * KL(own full || composed) on the answers (+ agreement * a hinge on composed's margin
    for full's greedy token)."""
    import torch

    from app.service.settings import Settings
    from hypic_core.errors import HypicError
    from hypic_core.models.loader import load_local
    from hypic_core.models.registry import resolve
    from training.reuse import data as D
    from training.reuse.links import link_ids
    from training.reuse.trainer import CHECKPOINT, TrainConfig, Trainer, export_adapter, run, say

    if data not in DATA:
        raise typer.BadParameter(f"expected one of {', '.join(DATA)}, got {data!r}", param_hint="--data")
    torch.set_num_threads(threads)
    settings = Settings()
    name = model or settings.model
    try:
        resolved = resolve(name, settings.models_dir, progress=say)
        student, tok = load_local(resolved.path)
        teacher_model = load_local(resolve(teacher, settings.models_dir, progress=say).path)[0] if teacher else None
    except HypicError as exc:
        typer.echo(f"hypic tune: {exc}", err=True)
        raise typer.Exit(1) from None
    served_link = resolved.prompt.get("link", "")
    if served_link and link and link != served_link:
        raise typer.BadParameter(f"{name} is served with the link {served_link!r}; train it with that one", param_hint="--link")
    link = link or served_link  # a model served with a link is read with it, and its rows train on
    try:
        ids = link_ids(tok, link) if link else ()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--link") from None
    layout = gateway_layout(name, tok, {**resolved.prompt, **({"link": link} if link else {})})
    if reply not in ("student", "sample"):
        raise typer.BadParameter(f"expected student or sample, got {reply!r}", param_hint="--reply")
    if method not in ("lora", "full"):
        raise typer.BadParameter(f"expected lora or full, got {method!r}", param_hint="--method")
    cfg = TrainConfig(model=name, out=str(out), teacher=teacher, rank=rank, method=method, seam=settings.seam if seam is None else seam,
                      lr=lr, minutes=minutes, steps=steps, save_minutes=save_minutes, seed=seed, precision=precision,
                      consistency=consistency, agreement=agreement, margin=margin, reply=reply, link=link, sources={"data": data})
    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",) if t in tok.get_vocab()]
    trainer = Trainer(cfg, student, teacher_model, eos=[e for e in eos if e is not None], link=ids)
    corpus = [t for _, t in D.training_documents()] if data != "index" else index_texts(index_dir or settings.index_dir, settings.embedder)
    # passages of 30-90 words, so 3-8 documents fit a training prompt (a user's ingested chunks are a few
    # hundred tokens each: whole, one or two filled a prompt, and there was little to compose)
    texts = D.passages(corpus, lo=30, hi=90) if data != "index" else D.pieces(corpus, lo=30, hi=90)
    if data == "distill":
        weights = (0.7, 0.3)

        def samples(cursor: int):
            n = D.counts(cursor, weights, seed)
            return D.mixed([D.distill_samples(tok, layout, texts, seed, n[0], link=ids), D.corpus_samples(texts, layout, seed, n[1])],
                           weights, seed, cursor)
    else:
        def samples(cursor: int):
            return ((i, s) for i, s in enumerate(D.corpus_samples(texts, layout, seed, cursor), cursor))

    if evaluate > 0:
        if (out / CHECKPOINT).is_file():
            trainer.load(out / CHECKPOINT)
        held = D.passages([t for _, t in D.heldout_documents()], lo=30, hi=90) if data != "index" else texts
        stream = D.corpus_samples(held, layout, seed + 1_000_003)
        result = trainer.measure([next(stream) for _ in range(evaluate)])
        out.mkdir(parents=True, exist_ok=True)
        (out / "evaluation.json").write_text(json.dumps(result, indent=1) + "\n")
        typer.echo(json.dumps(result))
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.json").write_text(json.dumps({"model": name, "teacher": teacher, "data": data, "method": method, "rank": rank,
                                                   "seam": cfg.seam, "lr": lr, "threads": threads, "precision": precision,
                                                   "consistency": consistency, "agreement": agreement, "margin": margin,
                                                   "reply": reply, "link": link}) + "\n")
    run(trainer, samples, out, on_save=lambda t: export_adapter(t, out / "adapter", {"data": data}), init=init)
    say(f"adapter written to {out / 'adapter'}; serve it with --model '{name}+{out / 'adapter'}'")


def main() -> None:
    typer.run(tune_command)


if __name__ == "__main__":
    main()
