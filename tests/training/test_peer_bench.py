"""bench/peer.py's pieces that decide what is measured: cells, the real-text workload, groups of
concurrent requests sent to every backend in turn, draft counts, and llama-server's command line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


peer = load_script("bench_peer", ROOT / "bench" / "peer.py")


@pytest.fixture(scope="module")
def maker(tiny_tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.save_pretrained(d)
    return peer.TextMaker(d / "tokenizer.json")


def test_cells_hold_whole_groups_of_streams():
    args = peer.parse_args(["--streams", "1", "8", "--max-tokens", "128", "256", "--num-requests", "5"])
    assert peer.cell_sizes(args) == [(1, 128, 5), (1, 256, 5), (8, 128, 8), (8, 256, 8)]
    args = peer.parse_args(["--streams", "2", "--num-requests", "5"])
    assert peer.cell_sizes(args) == [(2, 128, 4)]


def test_streams_and_tokens_must_be_positive():
    with pytest.raises(SystemExit):
        peer.parse_args(["--streams", "0"])
    with pytest.raises(SystemExit):
        peer.parse_args(["--max-tokens", "128", "0"])


def test_real_workload_copies_from_its_documents(maker):
    """Every measured request holds its question's gold passage among `--k` documents; cells, warm-up
    and measured requests use different questions; the warm-chunk pass has the same passages in
    another order."""
    from real_qa import load_real_qa

    args = peer.parse_args(["--workload", "real", "--k", "4", "--streams", "1", "2", "--max-tokens", "8",
                            "--num-requests", "3", "--warmup", "2"])
    assert args.warm_chunks
    work = peer.plan(args, maker)
    pairs = {p.question: p for p in load_real_qa()}
    measured = [it for _, _, items in work.cells for it in items]
    assert [len(items) for _, _, items in work.cells] == [3, 2]
    questions = [it.prompt for it in measured]
    assert len(set(questions)) == len(questions) == 5
    assert not {it.prompt for it in work.warmup} & set(questions)
    reordered = 0
    for it, again in zip(measured, work.rewarm):
        pair = pairs[it.prompt.removeprefix("Question: ").removesuffix("\nAnswer:")]
        assert it.segments[0] == peer.REAL_SYSTEM and len(it.segments) == 5
        assert f"Document: {pair.passage.strip()}\n" in it.segments
        assert again.prompt == it.prompt and sorted(again.segments) == sorted(it.segments)
        reordered += again.segments != it.segments
    assert reordered >= 4
    ids = peer.prompt_ids(maker, measured[0])
    assert len(ids) == sum(maker.count(t) for t in (*measured[0].segments, measured[0].prompt))


def test_groups_go_at_once_to_every_backend_in_turn():
    """Each group of `streams` requests is sent concurrently, backends one after another with the order
    rotated per group; draft counts come from the outcomes or from a backend's counters."""
    events: list[tuple[str, str, str]] = []
    counters = {"b": [0, 0]}

    def backend(name: str, drafted: int = 0, accepted: int = 0):
        async def send(item, max_tokens):
            events.append((name, "start", item.prompt))
            await asyncio.sleep(0.01)
            events.append((name, "end", item.prompt))
            out = peer.Outcome(ok=True, error=None, start=0.0, end=0.5, first_token=0.1, output_tokens=max_tokens,
                               text=item.prompt)
            if name == "a":
                out.drafted, out.accepted = drafted, accepted
            else:
                counters["b"][0] += 3
                counters["b"][1] += 2
            return out
        return send

    async def b_counts():
        return tuple(counters["b"])

    items = [peer.Item(("s",), f"q{i}", ()) for i in range(4)]
    tallies = asyncio.run(peer.run_cell({"a": backend("a", 4, 1), "b": backend("b")}, {"b": b_counts}, items, 2, 16))
    order = [(n, kind) for n, kind, _ in events]
    # group 1: a's two requests both start before either ends, then b's; group 2: b first, then a
    assert order == [("a", "start")] * 2 + [("a", "end")] * 2 + [("b", "start")] * 2 + [("b", "end")] * 2 \
        + [("b", "start")] * 2 + [("b", "end")] * 2 + [("a", "start")] * 2 + [("a", "end")] * 2
    assert [o.text for o in tallies["a"].outcomes] == ["q0", "q1", "q2", "q3"]
    assert (tallies["a"].drafted, tallies["a"].accepted) == (16, 4)
    assert (tallies["b"].drafted, tallies["b"].accepted) == (12, 8)
    row = peer.summarize("a", 2, 16, tallies["a"])
    assert row["kept"] == 0.25 and row["completed"] == 4
    assert row["output_throughput"] == pytest.approx(64 / tallies["a"].seconds)


def test_agreement_counts_identical_texts_and_matched_words():
    o = lambda text: peer.Outcome(ok=True, error=None, start=0, end=1, text=text)  # noqa: E731
    got = peer.agreement([o("a b c d"), o("a x c d")], [o("a b c d"), o("a b c d")])
    assert got["identical"] == 0.5 and got["prefix"] == pytest.approx((1.0 + 0.25) / 2)


def test_llama_server_command_per_streams_and_speculation(tmp_path, monkeypatch):
    monkeypatch.delenv("HYPIC_DECODE_KERNEL", raising=False)  # the label names the gateway's kernel: its default
    args = peer.parse_args(["--threads", "2", "--ctx", "4096"])
    one = peer.LlamaServer(Path("/bin/llama-server"), tmp_path / "m.gguf", args, "x", parallel=1, spec=False)
    many = peer.LlamaServer(Path("/bin/llama-server"), tmp_path / "m.gguf", args, "x", parallel=8, spec=True)
    opt = lambda cmd, flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert opt(one.cmd, "-np") == "1" and opt(one.cmd, "-c") == "4096" and "--cont-batching" not in one.cmd
    assert "--spec-type" not in one.cmd
    assert opt(many.cmd, "-np") == "8" and opt(many.cmd, "-c") == str(8 * 4096) and "--cont-batching" in many.cmd
    assert opt(many.cmd, "--spec-type") == "ngram-simple"
    names = peer.labels(args, [peer.Backend("llama-f32-spec"), peer.Backend("hypic")], {"llama-f32": "m.gguf"})
    assert names == {"llama-f32-spec": "llama.cpp m.gguf --spec-type ngram-simple",
                     "hypic": "gateway hypic (lean step, native kernel, speculation off)"}
    monkeypatch.setenv("HYPIC_DECODE_KERNEL", "native-i8")
    assert peer.labels(args, [peer.Backend("hypic-spec")], {})["hypic-spec"] == \
        "gateway hypic (lean step, native-i8 kernel, speculation on)"
