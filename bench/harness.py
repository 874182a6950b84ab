"""What the benchmarks share: an engine factory, a timer and the markdown section writer.

Benchmarks drive the engine through its public calls (`Engine.prefill`, `generate`, `add_request` /
`step`) or, to time the batched decode forward alone, through the one documented runner seam
`ModelRunner.decoding(caches)` (`decode_rows` here): never the runner's decode batch or its step's
attributes.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypic_core.config import EngineConfig  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from markdown_section import write_section  # noqa: E402,F401  (re-exported: the one section writer)


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the machine type: what a result file records."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def model_path(model: str) -> Path:
    """A checkpoint directory, or the path of a registry name (hypic models list)."""
    path = Path(model)
    if path.exists():
        return path
    from hypic_core.models.registry import resolve

    return resolve(model).path


def engine(model: str, dtype: torch.dtype = torch.float32, **config) -> Engine:
    """A fresh engine (its own copy of the model) on `model` with EngineConfig(**config)."""
    return Engine.from_pretrained(model_path(model), EngineConfig(**config), dtype=dtype)


class Timer:
    """Seconds of each timed block: `with timer: ...`; `median_ms`, `total`."""

    def __init__(self):
        self.seconds: list[float] = []

    def __enter__(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds.append(time.perf_counter() - self._t0)

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.seconds)

    @property
    def total(self) -> float:
        return sum(self.seconds)


@contextlib.contextmanager
def decode_rows(engine: Engine, caches: Sequence, ranges: bool = False) -> Iterator[Callable]:
    """The engine's batched decode forward on copies of `caches` (prefill caches, one row each):
    `ModelRunner.decoding`, yielding `step(token_ids, positions) -> logits [rows, vocab]`."""
    with torch.inference_mode(), engine.runner.decoding([copy.deepcopy(c) for c in caches], ranges=ranges) as step:
        yield step


def load_average() -> str:
    """The 1-minute load average (other jobs share the CPU: say so beside every number)."""
    return open("/proc/loadavg").read().split()[0]


def wait_until_ready(server, url: str, started: float, timeout: float, log: Path) -> None:
    """Poll `url`/ready until it answers 200, for a gateway started as the subprocess `server` at
    `started` (a `time.perf_counter()` value). Raises SystemExit naming `log` when the process exits
    first or `timeout` seconds pass."""
    import httpx

    while True:
        if server.poll() is not None:
            raise SystemExit(f"{' '.join(map(str, server.args))} exited with {server.returncode}; log: {log}")
        if time.perf_counter() - started > timeout:
            raise SystemExit(f"not ready after {timeout} s; log: {log}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
