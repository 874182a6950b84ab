"""The training script's pieces: encoding, learning-rate schedule, question mix, resuming."""

import json
import os
import random
from types import SimpleNamespace

import pytest

from training import train, world
from training.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_encode_marks_the_answers_source_token(tok):
    w = world.World(5)
    rng = random.Random(0)
    for kind in ("single", "two_hop", "follows"):
        ex = w.example(rng, kind, 4)
        enc = train.encode(tok, ex)
        answer_id = tok.convert_tokens_to_ids(ex.answer)
        assert enc.source_pos and all(enc.ids[p] == answer_id for p in enc.source_pos)
        assert enc.ids[enc.n_prompt] == answer_id and enc.ids[-1] == tok.eos_token_id
        # the source lies inside the source document's segment, not in the question
        segments, _ = world.prompt_segments(ex)
        doc_start = len(tok("".join(segments[:ex.sources[0][0] + 1]), add_special_tokens=False)["input_ids"])
        doc_end = len(tok("".join(segments[:ex.sources[0][0] + 2]), add_special_tokens=False)["input_ids"])
        assert all(doc_start <= p < doc_end for p in enc.source_pos)


def test_learning_rate_warms_up_holds_then_decays():
    args = SimpleNamespace(lr=1e-3, warmup=10, decay_start=100, decay_steps=50, min_lr_ratio=0.1)
    lrs = [train.learning_rate(args, s) for s in range(200)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3) and lrs[99] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[100:150], lrs[101:151]))
    assert lrs[150] == pytest.approx(1e-4) and lrs[199] == pytest.approx(1e-4)
    assert train.learning_rate(SimpleNamespace(**{**vars(args), "decay_start": None}), 10_000) == 1e-3


def test_kind_weights_parse_and_reject_unknown_kinds():
    assert train.parse_kind_weights("single=0.7,follows=0.3") == {"single": 0.7, "follows": 0.3}
    with pytest.raises(SystemExit, match="unknown kind 'lookup'"):
        train.parse_kind_weights("lookup=1")


def test_training_resumes_with_its_own_tokenizer(tmp_path):
    """Two steps, then one more from last.pt: the step count continues and the saved
    tokenizer (not a rebuilt one) is reused."""
    run = str(tmp_path / "run")
    common = ["--run-dir", run, "--hidden", "32", "--layers", "4", "--batch-size", "2", "--max-docs", "2",
              "--eval-every", "1000", "--ckpt-every", "1", "--kind-weights", "single=1"]
    train.main(common + ["--max-steps", "2"])
    vocab = json.load(open(os.path.join(run, "tokenizer", "tokenizer.json")))["model"]["vocab"]
    # a tokenizer that differs from a fresh build must survive the resume untouched
    marker = os.path.join(run, "tokenizer", "tokenizer_config.json")
    config = json.load(open(marker))
    config["model_max_length"] = 12345
    json.dump(config, open(marker, "w"))
    train.main(common + ["--max-steps", "3"])
    import torch
    state = torch.load(os.path.join(run, "last.pt"), weights_only=False)
    assert state["step"] == 3
    assert json.load(open(marker))["model_max_length"] == 12345
    assert json.load(open(os.path.join(run, "tokenizer", "tokenizer.json")))["model"]["vocab"] == vocab
    lines = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert lines == [] or all("step" in line for line in lines)
