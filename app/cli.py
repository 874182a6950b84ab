"""The `hypic` command line."""

from __future__ import annotations

import typer

from retrieval.cli import ingest_command

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="hypic-gateway: RAG serving with position-independent caching for hybrid LLMs.")
cli.command("ingest")(ingest_command)


@cli.callback()
def _group() -> None:
    """Keep `hypic <command>` syntax even while only one command is registered."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
