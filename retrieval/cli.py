"""The `hypic ingest` command: read files into a vector index, with a progress bar and a summary.

`app/cli.py` registers `ingest_command`, and sets `DEFAULTS` so that what is not given on the
command line comes from the gateway's settings (HYPIC_INDEX_DIR, HYPIC_EMBEDDER, HYPIC_MODEL,
HYPIC_CHUNK_TOKENS): the CLI writes the index a gateway with the same settings serves, chunked in
that gateway's model's tokenizer. The work is done by `retrieval.ingest`. A running gateway may
keep serving meanwhile: the two take turns at the index's write lock and each loads what the
other wrote (`retrieval.index`), so the gateway serves the new documents from its next request. Chunks are measured in
`--tokenizer DIR` if given, else the serving model's tokenizer, else models/hypic-tiny's when
that directory has one, else the embedder's own (MiniLM's for the hashing embedder).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from retrieval.errors import RetrievalError

DEFAULT_INDEX_DIR = Path("data/index")
SERVING_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "hypic-tiny"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class IngestDefaults:
    """What `hypic ingest` uses for the options it is not given."""

    index_dir: Path = DEFAULT_INDEX_DIR
    embedder: str = "minilm"
    model_dir: Path | None = None  # the serving model's checkpoint: its tokenizer and context size
    chunk_tokens: int | None = None


def _no_settings(model: str | None) -> IngestDefaults:
    return IngestDefaults(model_dir=Path(model) if model else None)


# model option -> defaults; app/cli.py replaces it with one that reads the gateway's settings.
DEFAULTS: Callable[[str | None], IngestDefaults] = _no_settings


def resolve_tokenizer(directory: Path | None, embedder: Any) -> Any:
    """The tokenizer to chunk with: `directory`'s, else the serving model's, else `embedder`'s
    (`embedder.tokenizer`), else MiniLM's. Raises `InvalidInputError` if `directory` has none."""
    from transformers import AutoTokenizer

    from retrieval.embedder import minilm_model_dir
    from retrieval.errors import InvalidInputError

    if directory is not None:
        if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
            raise InvalidInputError(f"{directory}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if any((SERVING_MODEL_DIR / name).is_file() for name in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(SERVING_MODEL_DIR), local_files_only=True)
    if getattr(embedder, "tokenizer", None) is not None:
        # A copy: chunking runs on its own thread while the embedder tokenizes, and a Rust
        # tokenizer must not be called from two threads at once.
        return copy.deepcopy(embedder.tokenizer)
    return AutoTokenizer.from_pretrained(str(minilm_model_dir()), local_files_only=True)


def context_window(directory: Path | None) -> int | None:
    """The context length (`max_position_embeddings`) in the config.json of `directory`, else of
    the serving model; None if neither has one."""
    for candidate in (directory, SERVING_MODEL_DIR):
        config = candidate / "config.json" if candidate is not None else None
        if config is not None and config.is_file():
            value = json.loads(config.read_text()).get("max_position_embeddings")
            if isinstance(value, int):
                return value
    return None


def ingest_command(
    paths: Annotated[list[Path], typer.Argument(help="Files (.txt, .md, .rst, .html, .jsonl, each optionally .gz) or directories to ingest.")],
    index_dir: Annotated[Path | None, typer.Option("--index-dir", help="Index directory, created if missing (default: HYPIC_INDEX_DIR or data/index).")] = None,
    embedder: Annotated[str | None, typer.Option("--embedder", help="minilm, hashing, hashing-DIM, or a model directory (default: HYPIC_EMBEDDER or minilm).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="The serving model, whose tokenizer and context size chunks follow (default: HYPIC_MODEL, else the gateway's default model).")] = None,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Tokenizer directory for chunk sizes (default: the serving model's).")] = None,
    target_tokens: Annotated[int | None, typer.Option("--target-tokens", help="Chunk size to aim for, in tokens (default: min(384, a quarter of the model's context)).")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Hard limit on a chunk's tokens (default: 4/3 of the target).")] = None,
    index_type: Annotated[str, typer.Option("--index-type", help="flat (exact) or hnsw; applies to a new index.")] = "flat",
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Embedding batches run at once, one torch thread each (default: one per usable core); results do not depend on it.")] = None,
    log_every: Annotated[float, typer.Option("--log-every", min=0.1, help="Seconds between progress lines when stderr is not a terminal.")] = 10.0,
    lock_timeout: Annotated[float | None, typer.Option("--lock-timeout", min=0.0, help="Seconds to wait while another process "
                                                       "(a gateway) writes the index, then give up (default: 60).")] = None,
) -> None:
    """Chunk, embed and index documents; a document already in the index is replaced."""
    from transformers.utils import logging as transformers_logging

    from retrieval.chunker import Chunker, default_chunk_tokens
    from retrieval.embedder import load_embedder
    from retrieval.index import LOCK_TIMEOUT_S, VectorIndex
    from retrieval.ingest import ingest_paths
    from retrieval.pipeline import ProgressLog

    console = Console(stderr=True)
    transformers_logging.disable_progress_bar()  # one bar on screen: ours
    try:
        defaults = DEFAULTS(model)
        index_dir = index_dir or defaults.index_dir
        tokenizer = tokenizer or defaults.model_dir
        embedding = load_embedder(embedder or defaults.embedder, workers=workers or len(os.sched_getaffinity(0)))
        index = VectorIndex(index_dir, embedding, index_type, lock_timeout=LOCK_TIMEOUT_S if lock_timeout is None else lock_timeout)
        target = target_tokens or defaults.chunk_tokens or default_chunk_tokens(context_window(tokenizer))
        chunker = Chunker(resolve_tokenizer(tokenizer, embedding), target, max_tokens or max(target, target * 4 // 3))
        if console.is_terminal:
            with Progress(TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("documents, {task.fields[rate]}"),
                          TimeElapsedColumn(), console=console) as bar:
                task = bar.add_task("embedding", total=None, rate="")
                summary = ingest_paths(paths, index, chunker, progress=lambda p: bar.update(
                    task, completed=p.documents, total=p.documents_total, rate=f"{p.chunks} chunks, {p.chunks_per_second:.1f} chunks/s"))
        else:  # a log file or a pipe: a line every few seconds instead of a bar
            summary = ingest_paths(paths, index, chunker, progress=ProgressLog(lambda p: typer.echo(p.line(), err=True), log_every))
    except (RetrievalError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=1) from exc
    for skipped in summary.skipped:
        console.print(f"[yellow]skipped[/yellow] {escape(skipped)}", soft_wrap=True)
    rate = summary.chunks / summary.seconds if summary.seconds > 0 else float("inf")
    typer.echo(
        f"ingested {summary.documents} documents ({summary.replaced} replaced) as {summary.chunks} chunks "
        f"in {summary.seconds:.2f} s ({rate:.1f} chunks/s) into {index_dir} [{len(index)} chunks total]"
    )
