"""The native kernel library as code we load (hypic_core/native/, decode_matmul.native()).

- Every ISA variant compiles as strict C++17 (-Werror -Wextra -Wvla -pedantic-errors); each one this CPU
  runs matches the plain torch references (fp32, fp16, bf16 and int8 weights; avx512bf16's bf16 product
  against x rounded to bf16 as vdpbf16ps rounds it; the norm, the gate and attention); the variant picked
  follows the CPU's flags, generic last; kernel_status() names it.
- Hostile kernel directories, in a child process (a library that loads runs its code there, never
  here): a planted library (its constructor writes a marker file), a symlinked library and a symlinked
  variant directory (each beside a manifest forged to match what they point at), a truncated library,
  a library without the kernels' symbols (with a manifest that matches it), a kernels directory
  writable by others and one owned by another user. Each: the marker never appears, the process does
  not crash, ONE warning, and either a rebuild (a verified library loaded) or torch's ops with the
  reason in kernel_status().
- A gateway on the bundled model with a hostile kernels directory and no compiler starts, answers and
  shows the reason on /health.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hypic_core.native import decode_matmul
from hypic_core.native import library

ROOT = Path(__file__).resolve().parents[2]
needs_cxx = pytest.mark.skipif(library.find_compiler() is None, reason="no C++ compiler here")
BEST = library.pick()


def compile_cpp(tmp: Path, name: str, code: str) -> Path:
    src, out = tmp / f"{name}.cpp", tmp / f"lib{name}.so"
    src.write_text(code)
    subprocess.run([library.find_compiler(), "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A kernels directory with the best variant and generic built and verified."""
    root = tmp_path_factory.mktemp("kernels") / "k"
    for v in {BEST, library.BY_NAME["generic"]}:
        library.build(root, v, library.find_compiler())
    return root


# --- sources, variants, numerics ------------------------------------------------------------------------
@needs_cxx
@pytest.mark.parametrize("variant", [v.name for v in library.VARIANTS])
def test_every_variant_compiles_as_strict_cxx17(variant, tmp_path):
    library.compile_variant(library.find_compiler(), library.BY_NAME[variant], tmp_path / "lib.so", strict=True)
    assert (tmp_path / "lib.so").stat().st_size > 0


def test_the_variant_follows_the_cpu_flags():
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert library.pick(frozenset()).name == "generic"
    assert library.pick(avx2).name == "avx2"
    assert library.pick(avx2 | {"avx512f", "avx512bw"}).name == "avx2"  # avx512vl missing
    assert library.pick(avx2 | {"avx512f", "avx512bw", "avx512vl"}).name == "avx512"
    assert library.pick(avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}).name == "avx512bf16"
    assert library.key(library.BY_NAME["avx2"]) != library.key(library.BY_NAME["avx512"])  # the variant is in the key
    with pytest.raises(RuntimeError, match="unknown kernel variant"):
        decode_matmul.build(variant="sse9")


def attend_reference(q, k, v, kb, vb, lens, scale):
    """Plain torch: write k, v at column lens[b] - 1 of row b, softmax(q K^T * scale) V over lens[b] columns."""
    B, H, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, H * D)
    for b in range(B):
        n = int(lens[b])
        kb[b, :, n - 1], vb[b, :, n - 1] = k[b], v[b]
        K, V = kb[b, :, :n].repeat_interleave(G, 0), vb[b, :, :n].repeat_interleave(G, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[b], K) * scale, -1)
        out[b] = torch.einsum("ht,htd->hd", p, V).reshape(-1)
    return out


@needs_cxx
@pytest.mark.parametrize("variant", [v.name for v in library.VARIANTS if not library.missing_flags(v)])
def test_each_variant_this_cpu_runs_matches_the_references(variant, built):
    kernels = decode_matmul.build(directory=built, variant=variant)
    assert kernels.variant == variant
    g = torch.Generator().manual_seed(0)
    for rows, out, n in ((1, 37, 45), (3, 64, 128), (5, 9, 7), (8, 576, 1536)):
        x, w, bias = torch.randn(rows, n, generator=g), torch.randn(out, n, generator=g), torch.randn(out, generator=g)
        for weight, scales, tol in ((w, None, 1e-4), (w.half(), None, 1e-4), (decode_matmul.to_bf16(w), None, 1e-4),
                                    (*decode_matmul.quantize_int8(w), 1e-3),
                                    *([(*decode_matmul.quantize_int8(w, 32), 1e-3)] if n % 32 == 0 else [])):
            xr = x
            if weight.dtype == torch.bfloat16 and variant == "avx512bf16":  # vdpbf16ps rounds x too, 32 at a time
                xr, whole = x.clone(), n // 32 * 32
                xr[:, :whole] = xr[:, :whole].bfloat16().float()
            ref = decode_matmul.reference(xr, weight, bias, scales)  # the rounded weights, widened: same products
            got = kernels.linear(x, weight.contiguous(), bias, scales)
            err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
            assert err < tol, f"{variant} {weight.dtype} {rows}x{out}x{n}: relative error {err:.2e}"
    h, d, nw = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    ref_h = h + d
    ref = nw * (ref_h * torch.rsqrt(ref_h.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = kernels.add_rmsnorm(h, d, nw, 1e-6)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    gu = torch.randn(4, 2 * 37, generator=g) * 4
    torch.testing.assert_close(kernels.silu_mul(gu), torch.nn.functional.silu(gu[:, :37]) * gu[:, 37:], rtol=1e-5, atol=1e-5)
    B, H, Hkv, D, cols = 3, 4, 2, 64, 300
    q, k, v = (torch.randn(B, h_, D, generator=g) for h_ in (H, Hkv, Hkv))
    kb, vb = torch.randn(B, Hkv, cols, D, generator=g), torch.randn(B, Hkv, cols, D, generator=g)
    lens = torch.tensor([1, 130, 300])
    ref = attend_reference(q, k, v, kb.clone(), vb.clone(), lens, 0.125)
    torch.testing.assert_close(kernels.attend(q, k, v, kb, vb, lens, 0.125), ref, rtol=1e-4, atol=1e-5)


@needs_cxx
def test_the_process_kernels_are_the_best_variant_and_status_says_so():
    kernels = decode_matmul.native()
    assert kernels is not None and kernels.variant == BEST.name
    status = decode_matmul.kernel_status()
    assert status["state"] == "loaded" and status["variant"] == BEST.name == status["best_variant"]
    manifest = json.loads((Path(status["library"]).parent / library.MANIFEST).read_text())
    assert status["sha256"] == manifest["sha256"] and manifest["size"] == Path(status["library"]).stat().st_size


@needs_cxx
def test_a_pinned_variant_is_loaded_instead_of_the_best_and_a_bad_one_is_named(built, monkeypatch):
    monkeypatch.setenv("HYPIC_KERNELS_DIR", str(built))
    monkeypatch.setattr(decode_matmul, "_built", {})
    monkeypatch.setenv(decode_matmul.VARIANT_ENV, "generic")  # runs on every CPU
    kernels = decode_matmul.native()
    assert kernels is not None and kernels.variant == "generic" and Path(kernels.path).parent.parent == built
    status = decode_matmul.kernel_status()
    assert (status["state"], status["variant"], status["pinned"], status["best_variant"]) == ("loaded", "generic", "generic", BEST.name)
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    torch.testing.assert_close(kernels.linear(x, w, None), decode_matmul.reference(x, w, None), rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(decode_matmul, "_built", {})
    monkeypatch.setenv(decode_matmul.VARIANT_ENV, "sse9")
    assert decode_matmul.native() is None  # torch's ops run; the reason is on /health
    status = decode_matmul.kernel_status()
    assert status["state"] == "unavailable" and "HYPIC_KERNEL_VARIANT='sse9' names no kernel variant" in status["reason"]


def test_a_check_failure_is_never_loaded(tmp_path):
    """The checks themselves, no library involved: what `verified_bytes` refuses before any dlopen."""
    with pytest.raises(library.Untrusted) as missing:
        library.verified_bytes(tmp_path / "none", BEST)
    assert missing.value.missing
    with pytest.raises(library.Untrusted, match="not an ELF"):
        library.check_elf(b"#!/bin/sh\n" + bytes(100))
    with pytest.raises(library.Untrusted, match="64-bit little-endian ELF shared object"):
        library.check_elf(b"\x7fELF" + bytes([1, 1]) + bytes(100))


# --- hostile kernel directories, in a child process ---------------------------------------------------
CHILD = textwrap.dedent("""
    import json, logging, os, sys
    records = []
    class Count(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())
    logging.getLogger("hypic").addHandler(Count())
    logging.getLogger("hypic").setLevel(logging.INFO)
    from hypic_core.native import decode_matmul
    for case, kdir, cxx in json.loads(sys.argv[1]):
        os.environ["HYPIC_KERNELS_DIR"], os.environ["CXX"] = kdir, cxx
        decode_matmul._built.clear(); records.clear()
        kernels = decode_matmul.native()
        if kernels is not None:  # the library loaded runs
            import torch
            x, w = torch.randn(2, 16), torch.randn(8, 16)
            assert torch.allclose(kernels.linear(x, w), x @ w.T, atol=1e-5)
        print(json.dumps({"case": case, "status": decode_matmul.kernel_status(), "warnings": list(records)}), flush=True)
""")


def fake_compiler(tmp: Path, good: Path) -> Path:
    """A "compiler" that writes the verified library `good` as its output: a rebuild without a compile's cost
    (the real compile is tested above)."""
    cxx = tmp / "fake-cxx"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo fake 1; exit 0; }}\n'
                   f'while [ $# -gt 1 ]; do [ "$1" = -o ] && {{ cp "{good}" "$2"; exit 0; }}; shift; done; exit 1\n')
    cxx.chmod(0o755)
    return cxx


def forge_manifest(vdir: Path, lib: Path) -> None:
    """The manifest an attacker with write access to the variant directory would write for `lib`."""
    m = json.loads((vdir / library.MANIFEST).read_text())
    data = lib.read_bytes()
    m.update(size=len(data), sha256=__import__("hashlib").sha256(data).hexdigest())
    (vdir / library.MANIFEST).write_text(json.dumps(m))


@pytest.fixture(scope="module")
def hostile(built, tmp_path_factory) -> dict:
    """Each case's kernels directory, set up here and loaded in one child process: case -> its result."""
    if library.find_compiler() is None:
        pytest.skip("no C++ compiler here")
    tmp = tmp_path_factory.mktemp("hostile")
    marker = tmp / "PLANTED-CODE-RAN"
    planted = compile_cpp(tmp, "planted", "#include <cstdio>\n__attribute__((constructor)) static void planted() {\n"
                          f'  std::FILE* f = std::fopen("{marker}", "w"); if (f) std::fclose(f);\n}}\n'
                          'extern "C" int hypic_kernels_abi(void) { return 2; }\n')
    symbolless = compile_cpp(tmp, "symbolless", 'extern "C" int unrelated(void) { return 0; }\n')
    name = library.subdir(BEST)
    good = built / name / library.LIBRARY
    fake = fake_compiler(tmp, good)
    cases, dirs = [], {}

    def case(label: str, cxx: str) -> Path:
        root = tmp / label / "kernels"
        shutil.copytree(built, root, symlinks=True)
        dirs[label] = root
        cases.append((label, str(root), cxx))
        return root / name

    v = case("planted", str(fake))
    shutil.copy(planted, v / library.LIBRARY)
    v = case("planted-no-compiler", "/nonexistent/g++")
    shutil.copy(planted, v / library.LIBRARY)
    v = case("symlinked-library", str(fake))
    (v / library.LIBRARY).unlink()
    (v / library.LIBRARY).symlink_to(planted)
    forge_manifest(v, planted)
    v = case("symlinked-directory", str(fake))
    elsewhere = tmp / "elsewhere"
    shutil.copytree(v, elsewhere)
    shutil.copy(planted, elsewhere / library.LIBRARY)
    forge_manifest(elsewhere, planted)
    shutil.rmtree(v)
    v.symlink_to(elsewhere, target_is_directory=True)
    v = case("truncated", "/nonexistent/g++")
    data = (v / library.LIBRARY).read_bytes()
    (v / library.LIBRARY).write_bytes(data[: len(data) // 2])
    v = case("truncated-rebuilt", str(fake))
    (v / library.LIBRARY).write_bytes(data[: len(data) // 3])
    v = case("symbol-less", "/nonexistent/g++")
    shutil.copy(symbolless, v / library.LIBRARY)
    forge_manifest(v, symbolless)  # as if built from the wrong sources: the digest matches, the symbols do not
    v = case("world-writable-directory", str(fake))
    shutil.copy(planted, v / library.LIBRARY)
    forge_manifest(v, planted)
    dirs["world-writable-directory"].chmod(0o777)
    if os.geteuid() == 0:
        v = case("other-owner", str(fake))
        shutil.copy(planted, v / library.LIBRARY)
        forge_manifest(v, planted)
        os.chown(dirs["other-owner"], 65534, 65534)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    results = {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
    return {"rc": done.returncode, "stderr": done.stderr, "marker": marker, "results": results, "dirs": dirs,
            "planted": planted, "good": good}


REBUILT = ("planted", "symlinked-library", "symlinked-directory", "truncated-rebuilt")
SKIPPED = {"planted-no-compiler": "failed its check", "truncated": "truncated",
           "symbol-less": "lacks hypic_", "world-writable-directory": "writable by group or others",
           "other-owner": "owned by uid 65534"}


@pytest.mark.parametrize("case", [*REBUILT, *SKIPPED])
def test_a_hostile_kernel_directory_is_never_loaded(hostile, case):
    if case == "other-owner" and os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    assert hostile["rc"] == 0, hostile["stderr"][-2000:]  # no crash (SIGBUS in dlopen, an uncaught error)
    assert not hostile["marker"].exists(), "the planted library's code ran"
    got = hostile["results"][case]
    assert len(got["warnings"]) == 1, got["warnings"]
    status = got["status"]
    if case in REBUILT:
        assert status["state"] == "loaded" and "rebuilt" in got["warnings"][0]
        lib = Path(status["library"])
        assert not lib.is_symlink() and not lib.parent.is_symlink()
        assert lib.read_bytes() == hostile["good"].read_bytes()
    else:
        assert status["state"] == "unavailable" and SKIPPED[case] in status["reason"], status
        assert SKIPPED[case] in got["warnings"][0]
    assert hostile["planted"].exists()  # a symlink's target is never written through


# --- the gateway ----------------------------------------------------------------------------------------
def test_a_gateway_with_a_hostile_kernel_directory_starts_answers_and_says_why(monkeypatch, tmp_path):
    """A planted library with a forged manifest in a world-writable kernels directory and no compiler: the
    bundled model's gateway still starts on torch's ops, answers, and /health names the reason."""
    import httpx

    from app.service.runtime import load_engine
    from gateways import app, served, settings

    kdir = tmp_path / "kernels" / library.subdir(BEST)
    kdir.mkdir(parents=True)
    (kdir / library.LIBRARY).write_bytes(b"\x7fELF" + bytes(200))
    (kdir / library.MANIFEST).write_text(json.dumps({"variant": BEST.name, "key": library.key(BEST), "size": 204}))
    (tmp_path / "kernels").chmod(0o777)
    monkeypatch.setenv("HYPIC_KERNELS_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(decode_matmul, "_built", {})
    engine = load_engine(settings(tmp_path, model=str(ROOT / "models" / "hypic-tiny"), decode_kernel="native",
                                  cache_dir=tmp_path / "cache"))
    assert engine.runner.decode_step == "lean" and engine.runner.batch.step.kernel == "torch"
    with served(app(tmp_path, engine)) as live:
        health = httpx.get(f"{live.url}/health").json()
        assert health["kernels"]["state"] == "unavailable"
        assert "writable by group or others" in health["kernels"]["reason"]
        r = httpx.post(f"{live.url}/v1/completions", json={"model": engine.model_id, "prompt": "Hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


# --- bf16 weights in the decode step --------------------------------------------------------------------
@needs_cxx
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_native_bf16_logits_stay_near_fp32(family):
    """kernel="native-bf16" (bf16 copies of the weights; on avx512bf16 the activations rounded too): lossy,
    so bounded, not exact (measured 2e-3 to 3.5e-2 here, fp16's 1.8e-4 to 2.8e-3); the fp32 weights the
    modules and the prefill use are untouched."""
    from engines import random_segments
    from hypic_core.config import GenerationRequest
    from hypic_core.testing import tiny_model
    from test_decode_kernels import MODES, SHAPES, decode_against_module, engine_on

    model = tiny_model(family)
    before = model.get_output_embeddings().weight.detach().clone()
    engine = engine_on(model, "native-bf16")
    step = engine.runner.batch.step
    assert step.kernel == "native-bf16" and step.lm_head.w.dtype == torch.bfloat16
    assert torch.equal(model.get_output_embeddings().weight, before) and model.dtype == torch.float32
    reqs = [GenerationRequest(random_segments(s, seed=i), mode=m) for i, (s, m) in enumerate(zip(SHAPES, MODES))]
    worst, _, _ = decode_against_module(engine, reqs, steps=6, join_at=2, leave_at=3)
    assert 2e-5 < worst < 0.1, f"{family}: max |logit diff| {worst:.3g}"


# --- the build CLI (what the Docker image runs) -----------------------------------------------------------
def test_the_build_cli_writes_each_variant_beside_its_manifest_and_names_a_bad_variant(built, tmp_path):
    """`python -m hypic_core.native build --dir D --variants generic`: the library and its manifest in
    D/<variant>-<key>/, one JSON line per variant, loaded and checked; an unknown variant exits 2 naming it."""
    if library.find_compiler() is None:
        pytest.skip("no C++ compiler here")
    generic = library.BY_NAME["generic"]
    fake = fake_compiler(tmp_path, built / library.subdir(generic) / library.LIBRARY)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "hypic_core.native", "build", "--dir", str(tmp_path / "k")]
    done = subprocess.run([*cli, "--variants", "generic", "--compiler", str(fake)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.splitlines()[-1])
    vdir = tmp_path / "k" / library.subdir(generic)
    manifest = json.loads((vdir / library.MANIFEST).read_text())
    assert line["variant"] == "generic" and line["loaded"] and line["sha256"] == manifest["sha256"]
    assert manifest["size"] == (vdir / library.LIBRARY).stat().st_size and manifest["compiler"] == "fake 1"
    assert not stat.S_IMODE((tmp_path / "k").stat().st_mode) & 0o022
    bad = subprocess.run([*cli, "--variants", "generic,sse9"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert bad.returncode == 2 and "--variants: unknown sse9" in bad.stderr


def test_kernel_status_never_waits_for_a_build(monkeypatch):
    """/health calls kernel_status while the engine may be compiling (native() holding its lock for seconds)."""
    import threading
    import time

    monkeypatch.setattr(decode_matmul, "_built", {})
    with decode_matmul._lock:
        t0 = time.perf_counter()
        status = {}
        worker = threading.Thread(target=lambda: status.update(decode_matmul.kernel_status()))
        worker.start()
        worker.join(timeout=5)
        assert not worker.is_alive() and time.perf_counter() - t0 < 1.0
    assert status["state"] == "loading"
