"""The engine area: hypic_core's engine, runner, adapters and models on tiny random models of every
family (and the bundled and SmolLM2 models): stitched prefill against full prefill, operators and
key rotation, the plan and its pins, exact prefixes and repeats, cold prefill and the prefill pool,
generation and sampling, kernel selection, the hybrid, and the layering and structure rules read from
the source. `engines.py` is the area's fixture factory: `engine(seam=..., family=..., **config)`."""

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: F401 - `from conftest import` finds them
