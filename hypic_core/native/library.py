"""The kernel library as code we load: one build per ISA variant, picked by the CPU's features, each
checked byte for byte before it is loaded.

Variants, best first (`VARIANTS`): `avx512bf16` (as avx512, bf16 weights on vdpbf16ps), `avx512` (AVX-512
F/BW/VL), `avx2` (AVX2 + FMA + F16C) and `generic` (plain C++, any CPU). `pick` takes the first whose CPU
flags (/proc/cpuinfo) are all present, as ggml-cpu does; the same sources build every variant (simd.h
gives each its vector type).

Layout under the kernels directory `root` (HYPIC_KERNELS_DIR, ~/.cache/hypic/kernels, or the image's
/opt/hypic/kernels): `<variant>-<key>/libhypic_kernels.so` beside `manifest.json`, where `key` hashes the
sources, the ABI, the variant and its flags (not the compiler: an image built with one runs without
any). The manifest records the library's size and sha256 at build time; it is written to a temporary
name, fsynced, renamed and the directory fsynced, after the library itself.

Trust (`load`): `root` and the variant directory must be real directories (opened O_NOFOLLOW, never
through a symlink) owned by this user or root and not writable by group or others; the manifest and the
library are read through O_NOFOLLOW descriptors (regular files, same owner and mode rules), the bytes
read are checked (size, ELF header for this machine, sha256 against the manifest), and those same
bytes are what `dlopen` maps: a private copy in a memfd (or a fresh private temporary directory), so the
checked file is the loaded file and a truncated one never reaches dlopen. Whatever fails a check is
never loaded: `Untrusted` says why; the caller rebuilds (`build`) when it can, else runs torch. A
library that passes them is loaded with every symbol of `SIGNATURES` typed, its ABI and variant
checked (RuntimeError otherwise), before anyone calls it.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
LIBRARY, MANIFEST = "libhypic_kernels.so", "manifest.json"
ABI = 4  # hypic_kernels.h HYPIC_KERNELS_ABI
MAX_LIBRARY = 64 << 20
COMMON_FLAGS = ("-std=c++17", "-O3", "-Wall", "-Wvla", "-Werror=vla", "-pedantic-errors", "-fopenmp", "-shared",
                "-fPIC")
STRICT_FLAGS = ("-Werror", "-Wextra")  # tests/engine/test_kernel_library.py builds every variant with these too


@dataclass(frozen=True)
class Variant:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags
    flags: tuple[str, ...]  # compiler flags


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", *_AVX2, "-DHYPIC_AVX512",
           # GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own `__Y = __Y` (GCC bug 105593)
           "-Wno-uninitialized", "-Wno-maybe-uninitialized")
_AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c")
VARIANTS = (  # best first
    # as avx512, but bf16 weights multiply on vdpbf16ps: the activations rounded to bf16 too (linear.cpp)
    Variant("avx512bf16", (*_AVX512_NEEDS, "avx512_bf16"), (*_AVX512, "-mavx512bf16", "-DHYPIC_AVX512BF16")),
    Variant("avx512", _AVX512_NEEDS, _AVX512),
    Variant("avx2", ("avx2", "fma", "f16c"), (*_AVX2, "-DHYPIC_AVX2")),
    Variant("generic", (), ()),
)
BY_NAME = {v.name: v for v in VARIANTS}
P_, L_, F_, I_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # name: (argument types, result type); hypic_kernels.h
    "hypic_kernels_abi": ([], I_),
    "hypic_kernels_variant": ([], ctypes.c_char_p),
    "hypic_linear_f32": ([P_] * 4 + [L_] * 3 + [I_], None),
    "hypic_linear_f16": ([P_] * 4 + [L_] * 3 + [I_], None),
    "hypic_linear_bf16": ([P_] * 4 + [L_] * 3 + [I_], None),
    "hypic_linear_i8": ([P_] * 5 + [L_] * 3 + [I_], None),
    "hypic_linear_q8": ([P_] * 5 + [L_] * 3 + [I_], None),
    "hypic_add_rmsnorm": ([P_, P_, P_, F_, P_, L_, L_], None),
    "hypic_silu_mul": ([P_, P_, L_, L_], None),
    "hypic_attend": ([P_] * 9 + [L_, P_] + [L_] * 8 + [F_, I_], I_),  # 1: a length or row out of the buffers
    "hypic_mamba2": ([P_] * 9 + [F_, P_] + [L_] * 6 + [I_], None),
    "hypic_mlp_block": ([P_] * 3 + [F_] + [P_] * 6 + [I_, P_] + [L_] * 3 + [I_], None),
    "hypic_norm_linear": ([P_] * 3 + [F_] + [P_] * 3 + [I_, P_] + [L_] * 3 + [I_], None),
    "hypic_mamba2_block": ([P_] * 3 + [F_] + [P_] * 6 + [I_, L_] + [P_] * 8 + [F_, P_] + [L_] * 7 + [I_], None),
    "hypic_attention_block": ([P_] * 3 + [F_] + [P_] * 6 + [I_] + [P_] * 6 + [L_, P_] + [L_] * 9 + [F_, I_], I_),
}


def cache_dir() -> Path:
    """Where built kernels are kept: $HYPIC_KERNELS_DIR, else ~/.cache/hypic/kernels."""
    env = os.environ.get("HYPIC_KERNELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hypic" / "kernels"


class Untrusted(Exception):
    """A kernel library or directory that failed a check; never loaded. `missing`: nothing is there yet."""

    def __init__(self, reason: str, missing: bool = False):
        super().__init__(reason)
        self.missing = missing


@dataclass
class Loaded:
    lib: ctypes.CDLL
    variant: str
    path: Path  # the checked file (what was mapped is a private copy of its bytes)
    sha256: str
    handle: int  # the memfd kept open while the library is mapped (its /proc name must not be reused)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return frozenset()


def missing_flags(variant: Variant, flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [f for f in variant.needs if f not in flags]


def pick(flags: frozenset[str] | None = None) -> Variant:
    """The best variant this CPU runs (`generic` always does)."""
    return next(v for v in VARIANTS if not missing_flags(v, flags))


def sources() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(SOURCE_DIR.iterdir()) if p.suffix in (".cpp", ".h")}


def key(variant: Variant) -> str:
    h = hashlib.sha256(f"abi {ABI}\n{variant.name}\n{' '.join(COMMON_FLAGS + variant.flags)}\n".encode())
    for name, data in sources().items():
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def subdir(variant: Variant) -> str:
    return f"{variant.name}-{key(variant)}"


# --- checked directories and files ----------------------------------------------------------------------
def _check_owner_mode(st: os.stat_result, what: str) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise Untrusted(f"{what} is owned by uid {st.st_uid}, not this user ({os.geteuid()}) or root")
    if st.st_mode & 0o022:
        raise Untrusted(f"{what} is writable by group or others (mode {oct(stat.S_IMODE(st.st_mode))})")


def _open_dir(name: str | Path, dir_fd: int | None = None, create: bool = False) -> int:
    """An O_NOFOLLOW descriptor of a directory we trust (created 0755 when asked and missing: readable by an
    image's unprivileged user, writable by its owner alone)."""
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise Untrusted(f"cannot create {name}: {exc}", missing=True) from exc
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise Untrusted(f"{name} does not exist", missing=True) from exc
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where a directory should be
        raise Untrusted(f"{name} is not a plain directory ({exc.strerror})") from exc
    try:
        _check_owner_mode(os.fstat(fd), f"directory {name}")
    except Untrusted:
        os.close(fd)
        raise
    return fd


def open_root(root: Path, create: bool = False) -> int:
    """The kernels directory itself (its parents are the operator's; only the last component is ours)."""
    if create:
        root.parent.mkdir(parents=True, exist_ok=True)
    return _open_dir(root, create=create)


def _read(dir_fd: int, name: str, limit: int) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise Untrusted(f"{name} is missing", missing=True) from exc
    except OSError as exc:
        raise Untrusted(f"{name} cannot be opened without following links ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{name} is not a regular file")
        _check_owner_mode(st, name)
        if st.st_size > limit:
            raise Untrusted(f"{name} is {st.st_size} bytes, more than {limit}")
        return f.read(limit + 1)


def _elf_machine(header: bytes) -> int:
    return int.from_bytes(header[18:20], "little")


def _host_machine() -> int:
    for exe in ("/proc/self/exe", sys.executable):
        try:
            with open(exe, "rb") as f:
                return _elf_machine(f.read(20))
        except OSError:
            continue
    return -1


def check_elf(data: bytes) -> None:
    """A 64-bit little-endian shared object for this machine, or Untrusted."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise Untrusted(f"not an ELF file ({len(data)} bytes)")
    if data[4] != 2 or data[5] != 1 or int.from_bytes(data[16:18], "little") != 3:
        raise Untrusted("not a 64-bit little-endian ELF shared object")
    if (host := _host_machine()) not in (-1, _elf_machine(data)):
        raise Untrusted(f"an ELF for machine {_elf_machine(data)}, this one is {host}")


def verified_bytes(root: Path, variant: Variant) -> tuple[bytes, dict]:
    """The library's bytes and its manifest, after every check above (Untrusted otherwise)."""
    root_fd = open_root(root)
    try:
        dfd = _open_dir(subdir(variant), dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        manifest = json.loads(_read(dfd, MANIFEST, 1 << 16))
        data = _read(dfd, LIBRARY, MAX_LIBRARY)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Untrusted(f"{MANIFEST} is not valid JSON") from exc
    finally:
        os.close(dfd)
    if not isinstance(manifest, dict) or manifest.get("key") != key(variant) or manifest.get("variant") != variant.name:
        raise Untrusted(f"{MANIFEST} is not this build's (variant {variant.name}, key {key(variant)})")
    if len(data) != manifest.get("size"):
        raise Untrusted(f"{LIBRARY} is {len(data)} bytes, the manifest says {manifest.get('size')}: truncated or replaced")
    check_elf(data)
    if (digest := hashlib.sha256(data).hexdigest()) != manifest.get("sha256"):
        raise Untrusted(f"{LIBRARY}'s sha256 {digest[:16]}... is not the manifest's: replaced")
    return data, manifest


def load(root: Path, variant: Variant) -> Loaded:
    """dlopen the checked bytes (a private copy: the file cannot change between the check and the map),
    then type every symbol of SIGNATURES. RuntimeError, before any call, when a symbol is missing or the
    library's ABI or variant is not the one asked for."""
    data, manifest = verified_bytes(root, variant)
    path = root / subdir(variant) / LIBRARY
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("hypic_kernels", os.MFD_CLOEXEC)
        _write_all(fd, data)
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    else:
        fd, private = -1, Path(tempfile.mkdtemp(prefix="hypic-kernels-")) / LIBRARY
        private.write_bytes(data)
        lib = ctypes.CDLL(str(private))
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise RuntimeError(f"the kernel library {path} lacks {', '.join(missing)}")
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    abi, built_for = lib.hypic_kernels_abi(), lib.hypic_kernels_variant().decode()
    if abi != ABI or built_for != variant.name:
        raise RuntimeError(f"the kernel library {path} is ABI {abi} variant {built_for}, "
                           f"expected ABI {ABI} variant {variant.name}")
    return Loaded(lib, variant.name, path, manifest["sha256"], fd)


# --- building ---------------------------------------------------------------------------------------------
def compiler_version(compiler: str) -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()
    return out[0] if out else compiler


def compile_variant(compiler: str, variant: Variant, out: Path, strict: bool = False) -> None:
    """Compile the sources for `variant` into `out`; RuntimeError with the compiler's message on failure."""
    srcs = [str(SOURCE_DIR / n) for n in sources() if n.endswith(".cpp")]
    flags = [*COMMON_FLAGS, *(STRICT_FLAGS if strict else ()), *variant.flags, f"-DHYPIC_VARIANT={variant.name}"]
    done = subprocess.run([compiler, *flags, *srcs, "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed on variant {variant.name}: {done.stderr.strip()[-800:]}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    tmp = f".{name}.{os.getpid()}.tmp"
    try:  # a crashed builder's leftover (we hold the directory's lock)
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


@contextmanager
def _locked(dir_fd: int):
    fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build(root: Path, variant: Variant, compiler: str) -> Path:
    """Compile `variant` into root/<variant>-<key>/ with its manifest, replacing whatever failed its check
    there (a symlink where the directory should be is removed, never followed). Returns the library's path.
    Raises Untrusted when root itself is not ours, RuntimeError when the compiler fails."""
    root_fd = open_root(root, create=True)
    try:
        name = subdir(variant)
        try:
            if stat.S_ISLNK(os.lstat(name, dir_fd=root_fd).st_mode):
                os.unlink(name, dir_fd=root_fd)
        except FileNotFoundError:
            pass
        dfd = _open_dir(name, dir_fd=root_fd, create=True)
    finally:
        os.close(root_fd)
    try:
        with _locked(dfd):
            try:  # a concurrent builder may have finished while we waited
                verified_bytes(root, variant)
                return root / name / LIBRARY
            except Untrusted:
                pass
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="hypic-build-") as tmp:
                out = Path(tmp) / LIBRARY
                compile_variant(compiler, variant, out)
                data = out.read_bytes()
            manifest = {"variant": variant.name, "key": key(variant), "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(), "abi": ABI,
                        "compiler": compiler_version(compiler), "flags": [*COMMON_FLAGS, *variant.flags],
                        "build_s": round(time.perf_counter() - t0, 2)}
            _write_atomic(dfd, LIBRARY, data)  # the library first: a manifest never names bytes not yet there
            _write_atomic(dfd, MANIFEST, json.dumps(manifest, indent=1).encode())
    finally:
        os.close(dfd)
    return root / name / LIBRARY


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
