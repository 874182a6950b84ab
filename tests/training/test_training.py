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
    # the optimizer resumed too: Adam has counted all three steps, not one
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {3}


def test_length_buckets_keep_every_example_and_cut_padding(tok):
    w, rng = world.World(5), random.Random(0)
    items = [train.encode(tok, w.example(rng, "single", rng.randint(1, 10))) for _ in range(64)]
    batches = train.length_buckets(items, 16, random.Random(1))
    assert sorted(id(e) for b in batches for e in b) == sorted(id(e) for e in items)
    assert [len(b) for b in batches] == [16] * 4

    def padded(bs):
        return sum(max(len(e.ids) for e in b) * len(b) for b in bs)
    assert padded(batches) < padded([items[i:i + 16] for i in range(0, 64, 16)])


def test_memory_heads_stay_pinned_through_training(tmp_path):
    import math

    import torch
    run = str(tmp_path / "run")
    train.main(["--run-dir", run, "--hidden", "32", "--layers", "4", "--batch-size", "2", "--max-docs", "2",
                "--eval-every", "1000", "--ckpt-every", "1", "--kind-weights", "single=1", "--lr", "0.05",
                "--warmup", "1", "--memory-heads", "0:1,2:0", "--memory-decay", "0.002", "--max-steps", "3"])
    state = torch.load(os.path.join(run, "last.pt"), weights_only=False)["model"]
    for layer, head in ((0, 1), (2, 0)):
        assert state[f"model.layers.{layer}.linear_attn.A_log"][head].item() == pytest.approx(math.log(0.002))
        assert state[f"model.layers.{layer}.linear_attn.dt_bias"][head].item() == 0.0
    # the other heads trained as usual (a large learning rate moves them off their init of 1.0)
    assert state["model.layers.0.linear_attn.dt_bias"][0].item() != 1.0


def test_memory_heads_must_be_linear_attention_heads(tmp_path):
    args = ["--run-dir", str(tmp_path / "run"), "--hidden", "32", "--layers", "4", "--max-steps", "1",
            "--batch-size", "2", "--kind-weights", "single=1"]
    with pytest.raises(SystemExit, match="--memory-heads: 3:0 is not a head of a linear-attention layer"):
        train.main(args + ["--memory-heads", "3:0"])
    with pytest.raises(SystemExit, match="--memory-heads: 0:9"):
        train.main(args + ["--memory-heads", "0:9"])


def test_binding_labels_span_each_document_from_its_name_and_the_question_from_its_subject(tok):
    w, rng = world.World(5), random.Random(0)
    ex = w.example(rng, "single", 4)
    enc = train.encode(tok, ex)
    labels = train.collate([enc], tok.pad_token_id).bind_labels[0].tolist()
    segments, _ = world.prompt_segments(ex)
    bounds = [len(tok("".join(segments[:i]), add_special_tokens=False)["input_ids"]) for i in range(len(segments) + 1)]
    assert set(labels[:bounds[1]]) == {-100}  # the system segment belongs to no entity
    for i, doc in enumerate(ex.docs):
        name_id = tok.convert_tokens_to_ids(doc.title)
        span = labels[bounds[i + 1]:bounds[i + 2]]
        first = enc.ids[bounds[i + 1]:bounds[i + 2]].index(name_id)
        assert set(span[:first]) <= {-100} and span[first:] == [name_id] * (len(span) - first)
    subject = next(d.title for d in ex.docs if d.title in ex.question)
    question = labels[bounds[-2]:enc.n_prompt]
    assert question[-1] == tok.convert_tokens_to_ids(subject) and question[0] == -100
    assert set(labels[enc.n_prompt:]) == {-100}  # nor does the answer


def test_binding_probe_trains_resumes_and_stays_out_of_the_model(tmp_path):
    import torch
    run = str(tmp_path / "run")
    common = ["--run-dir", run, "--hidden", "32", "--layers", "4", "--batch-size", "2", "--max-docs", "3",
              "--eval-every", "1000", "--ckpt-every", "1", "--kind-weights", "single=1", "--bind-weight", "0.5"]
    train.main(common + ["--max-steps", "2"])
    first = torch.load(os.path.join(run, "last.pt"), weights_only=False)
    train.main(common + ["--max-steps", "3"])
    state = torch.load(os.path.join(run, "last.pt"), weights_only=False)
    from transformers import Qwen3_5TextConfig
    fresh = train.build_model(Qwen3_5TextConfig.from_dict(state["config"])).state_dict()
    assert set(state["model"]) == set(fresh)  # the probe is not part of the model (nor of its export)
    assert not torch.equal(first["probe"]["proj.weight"], state["probe"]["proj.weight"])  # it trained on
    assert {int(s["step"]) for s in state["probe_optimizer"]["state"].values()} == {3}  # and resumed


def test_lookup_and_binding_diagnostics_account_for_every_question(tmp_path):
    from training import diagnose
    run = str(tmp_path / "run")
    train.main(["--run-dir", run, "--hidden", "32", "--layers", "4", "--batch-size", "2", "--max-docs", "2",
                "--eval-every", "1000", "--max-steps", "1", "--kind-weights", "single=1"])
    ckpt = os.path.join(run, "last.pt")
    looked = diagnose.lookup(ckpt, k=3, n=6, batch_size=4)
    assert sum(looked["strongest_attention"].values()) == 6
    assert sum(int(v.split("/")[1]) for v in looked["per_relation"].values()) == 6
    bound = diagnose.binding(ckpt, steps=2, k=3, batch_size=2, n_eval=4)
    assert 0.0 <= bound["probe_accuracy"] <= 1.0 and bound["chance"] == round(1 / 3, 3)
    assert bound["tokens_scored"] > 4 * 3 * 5  # most of every document's tokens are scored
