"""bench/decode_precision.py's table: answers, answers lost and gained against the first (fp32) kernel,
identical answers and the share of fp32's tokens matched, from rows as the benchmark writes them."""

from __future__ import annotations

from helpers import ROOT, load_script

bench = load_script("bench_decode_precision", ROOT / "bench" / "decode_precision.py")


def row(acc: bool, answer: str, matched: int, tokens: int) -> dict:
    return {"id": "q", "answer": answer, "acc": acc, "same": False, "matched": matched, "tokens": tokens}


def test_table_pairs_every_kernel_with_fp32():
    fp32 = [row(True, "a", 4, 4), row(True, "b", 2, 2), row(False, "c", 6, 6)]
    for r in fp32:
        r["same"] = True
    int8 = [row(True, "a", 4, 4), row(False, "x", 1, 3), row(True, "y", 3, 5)]
    int8[0]["same"] = True
    result = {"kernels": ["native", "native-i8"], "rows": {"native": fp32, "native-i8": int8}, "max_tokens": 8,
              "ms_per_token": {"native": 22.5, "native-i8": 13.0}}
    ref, lossy = bench.table(result)[2:]
    assert ref.startswith("| native | fp32 | 2/3 ") and "| 0 / 0 | 3/3 | 100% | 22.5 |" in ref
    # int8: lost the second answer, gained the third; one answer identical; 4 + 1 + 3 of fp32's 12 tokens matched
    assert lossy.startswith("| native-i8 | int8 copy, per-row scales | 2/3 ") and "| 1 / 1 | 1/3 | 67% | 13.0 |" in lossy
