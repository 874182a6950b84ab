"""Which model is served: named models, directories, .gguf files, cached hub ids; dtype; SmolLM2 end to end."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.models import registry
from hypic_core.models.loader import pick_dtype
from hypic_core.models.registry import MODEL_STAMP, KNOWN_MODELS, ModelNotFoundError, REPO_ROOT, resolve, served_name

EIFFEL = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
          "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")
COLOSSEUM = ("The Colosseum is an elliptical amphitheatre in the centre of the city of Rome, Italy. Construction began "
             "under the emperor Vespasian in AD 72 and was completed in AD 80 under his successor Titus.")


def test_named_bundled_model_resolves_to_its_directory():
    model = resolve("hypic-tiny")
    assert model.path == REPO_ROOT / "models" / "hypic-tiny" and model.name == "hypic-tiny" and model.known is KNOWN_MODELS["hypic-tiny"]
    assert registry.known_for(model.path) is KNOWN_MODELS["hypic-tiny"]


def test_directory_file_and_unknown_specs(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert resolve(tmp_path / "mine").name == "mine" and resolve(str(tmp_path / "mine")).source == "directory"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve(tmp_path / "weights.bin")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve("nobody/nothing-here", cache_dir=tmp_path)
    message = str(caught.value)
    assert "hypic-tiny" in message and "models--nobody--nothing-here" in message and "never downloads" in message


def test_hub_id_is_found_in_the_local_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--acme--small" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hub" / "models--acme--small" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--small" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = resolve("acme/small")
    assert model.path == snapshot and model.name == "acme/small" and model.source == "hub"
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "hub")):
        resolve("acme/other")


def test_a_gguf_file_is_converted_into_the_cache_under_its_digest(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "convert_gguf", lambda gguf, target, **kw: calls.append((gguf, target)) or target)
    gguf = tmp_path / "My-Model.Q4.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    model = resolve(gguf, cache_dir=tmp_path / "cache")
    assert model.name == "My-Model.Q4" and model.source == "gguf"
    assert calls == [(gguf, model.path)] and model.path.parent == tmp_path / "cache"
    assert model.path.name.startswith("My-Model.Q4-")
    assert served_name(str(gguf)) == "My-Model.Q4"


def test_two_processes_starting_at_once_convert_a_gguf_file_once(tmp_path, monkeypatch):
    """The second caller waits for the first's conversion and reuses it; before the lock, it
    converted again and replaced the directory while the first was loading from it."""
    import threading
    import time

    converted = []

    def slow_convert(gguf, target, identity, progress):
        converted.append(threading.current_thread().name)
        time.sleep(0.5)
        target.mkdir()
        (target / MODEL_STAMP).write_text(json.dumps(identity))
        return target

    monkeypatch.setattr(registry, "_convert_gguf", slow_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    results = []
    threads = [threading.Thread(target=lambda: results.append(registry.convert_gguf(gguf, tmp_path / "m"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "m", tmp_path / "m"] and len(converted) == 1


def test_smollm2_conversion_is_reused(smollm2_dir):
    stamp = json.loads((smollm2_dir / MODEL_STAMP).read_text())
    assert stamp["named"] == "smollm2-135m-instruct" and stamp["gguf"].endswith(".gguf")
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = resolve("smollm2-135m-instruct")
    assert again.path == smollm2_dir and weights.stat().st_mtime_ns == before
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in smollm2_dir.iterdir()}
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())


def test_served_names():
    assert served_name("hypic-tiny") == "hypic-tiny"
    assert served_name("acme/small") == "acme/small"
    assert served_name(str(REPO_ROOT / "models" / "hypic-tiny")) == "hypic-tiny"


def test_settings_take_the_model_from_the_environment(monkeypatch):
    from app.service.settings import Settings

    monkeypatch.setenv("HYPIC_MODEL", "smollm2-135m-instruct")
    assert Settings(_env_file=None).served_model_name == "smollm2-135m-instruct"
    assert Settings(_env_file=None, model_name="mine").served_model_name == "mine"


def test_exact_runs_budget_is_read_under_its_name_and_its_former_one(monkeypatch):
    from app.service.settings import Settings

    assert Settings(_env_file=None).exact_runs_bytes == 512 << 20
    monkeypatch.setenv("HYPIC_PREFIX_CACHE_BYTES", "1000")
    assert Settings(_env_file=None).exact_runs_bytes == 1000
    monkeypatch.setenv("HYPIC_EXACT_RUNS_BYTES", "2000")  # the current name wins
    assert Settings(_env_file=None).exact_runs_bytes == 2000


def test_models_command_lists_every_named_model():
    from app.cli import cli

    result = CliRunner().invoke(cli, ["models"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in KNOWN_MODELS:
        assert name in result.output
    assert "llama" in result.output and "yes" in result.output


def test_dtype_choice():
    assert pick_dtype("auto", "cpu", {"dtype": "bfloat16"}) == torch.float32
    assert pick_dtype("auto", "cuda", {"dtype": "float32"}) == torch.bfloat16
    assert pick_dtype("auto", "cuda", {"dtype": "float16"}) == torch.float16
    assert pick_dtype("bfloat16", "cpu", {}) == torch.bfloat16
    with pytest.raises(Exception, match="dtype must be"):
        pick_dtype("int8", "cpu", {})


def test_bfloat16_engine_keeps_operators_in_float32():
    """In bf16 the cache holds K/V in the model's dtype, (T, E) in fp32; a seam covering every
    segment still reproduces full prefill's answer."""
    engine = Engine.from_pretrained(REPO_ROOT / "models" / "hypic-tiny", EngineConfig(seam=8), dtype="bfloat16")
    assert engine.runner.model.dtype == torch.bfloat16
    tok = engine.tokenizer
    segs = tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in
                 ("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\n", "Document: Varo is a city.\n",
                  "Question: What is Varo?<|im_end|>\n<|im_start|>assistant\n"))
    entry = engine.segment_entries(segs[1:2], 8).entries[0]
    assert all(k.dtype == torch.bfloat16 for k in entry.keys)
    assert all(op.transition.dtype == torch.float32 for op in entry.operators)
    wide = max(map(len, segs))
    full = engine.prefill(GenerationRequest(segs, mode="full")).logits
    stitched = engine.prefill(GenerationRequest(segs, mode="hypic", seam=wide)).logits
    assert full.argmax() == stitched.argmax()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Engine.from_pretrained(smollm2_dir, EngineConfig(seam=8), model_id="smollm2-135m-instruct")


def _eiffel_segments(engine, model: str = "smollm2-135m-instruct"):
    """The Eiffel Tower question over the Eiffel and Colosseum passages, as the gateway lays it out for `model`."""
    from app.service.prompter import Prompter
    from app.service.settings import Settings
    from retrieval.document import Chunk, chunk_id_for
    from retrieval.index import SearchHit

    layout = Settings(_env_file=None).prompt_layout(engine.tokenizer, KNOWN_MODELS[model].prompt)
    hits = [SearchHit(s, Chunk(chunk_id_for(t), f"d{s}", "", "t", 0, t, 0)) for s, t in ((0.9, EIFFEL), (0.2, COLOSSEUM))]
    return tuple(Prompter(engine.tokenizer, layout, engine.max_positions).query(
        "In which year was the Eiffel Tower completed?", hits, reserve=16).segments)


def test_smollm2_answers_a_real_question(smollm2):
    segs = _eiffel_segments(smollm2)
    for mode in ("full", "hypic"):
        answer = smollm2.tokenizer.decode(smollm2.generated_tokens(GenerationRequest(segs, mode=mode, sampling=SamplingParams(max_tokens=16))))
        assert "1889" in answer, (mode, answer)


def test_smollm2_stitched_prefill_with_a_wide_seam_equals_full(smollm2):
    """The golden check on a real dense model: every segment recomputed in context is full prefill."""
    segs = _eiffel_segments(smollm2)
    full = smollm2.prefill(GenerationRequest(segs, mode="full")).logits
    stitched = smollm2.prefill(GenerationRequest(segs, mode="hypic", seam=max(map(len, segs)))).logits
    assert torch.allclose(full, stitched, atol=1e-4, rtol=1e-4), (full - stitched).abs().max()
