"""The engine area: hypic_core's engine, runner, adapters and models on tiny random models of every
family (and the bundled and SmolLM2 models): stitched prefill against full prefill, operators and
key rotation, the plan and its pins, exact prefixes and repeats, cold prefill and the prefill pool,
generation and sampling, the lean decode step, kernel selection, the hybrid, and the layering and
structure rules read from the source. `engines.py` is the area's fixture factory: the tests build their
engines with `engine(seam, family, *, model=, tokenizer=, like=, store=, ..., **config)`, on the shared
`model(family, **overrides)` unless a test brings its own (only the constructor's refusals call Engine)."""

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them
