"""The `hypic` command line."""

from __future__ import annotations

import typer

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="hypic-gateway: RAG serving with position-independent caching for hybrid LLMs.")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
