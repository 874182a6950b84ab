"""Which implementation a linear layer's ops run: the package kernel transformers found, or its torch fallback.

How transformers 5.24 chooses. Each mixer op is a module-level function of the modeling module
(`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, `mamba2_chunk_scan`, ...) decorated with
`use_kernel_func_from_hub_with_fallback(func_name, package)`. At import of the modeling module the
decorator tries `package` (fla, causal_conv1d, mamba_ssm) and binds, in a closure, either that
package's kernel or the torch function itself; the module attribute is the wrapper (its
`__wrapped__` is the torch function). The mixer forwards call those attributes by name. There are
no per-layer instance attributes and no `cuda_kernels_forward` / `is_fast_path_available`
branches any more (transformers 4.x had them), so one import decides for every layer of every
model of that family, on every device: with fla importable, a CPU model would call Triton.
(With the `kernels` package installed and a model loaded with `use_kernels=True`, hub kernels
take precedence; the pinning below bypasses them too, since it takes over the module attribute.)

What this module does with it:
- `KernelSelection.install` puts a `DeviceDispatch` in front of every op transformers bound to a
  package: CUDA tensors go to the package kernel, anything else to the torch fallback. Without a
  package (this CPU suite) it changes nothing.
- `implementation(name, device)` / `plan(device)` report what a call on `device` will run.
- `torch_patches()` pins every op to its torch fallback. The adapters apply it around their
  capture, fused-capture and stitch forwards, and compute operators with `fallback(name)`: their
  wrappers rely on the fallback's signature (`chunk_size`; states of any width, e.g. [S | I]) and
  on its precision (it upcasts to fp32 for the whole recurrence). Plain forwards (full prefill,
  decode) run the fast kernels.
- `patched(patches)` applies such patches (and the adapters' capture and stitch wrappers) for a
  `with` block on the calling thread only, through a `PatchPoint` dispatcher installed once in
  place of each patched attribute (threads: see `PatchPoint`).

The math is the same; the precision is not. The torch fallbacks compute the recurrence in fp32
whatever the model dtype. fla's chunked kernels keep q/k/v (and the intra-chunk WY factors) in the
input dtype, bf16 in a bf16 model, accumulating in fp32 with fp32 states; Triton matmuls on fp32
inputs may use TF32. Measured on an H200 (fla 0.6.0, bench/gpu_kernels.py): fp32 tiny models,
fla plain forwards against torch-computed operators, 2-4e-4 max |logit diff| and 1-2e-3 relative
state error (torch alone: ~1e-7); a 2k-token prefill, fla vs torch logits, 1e-3..2e-2 in fp32 and
4e-2..0.2 in bf16.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

# Device types on which a package kernel may run. Tests add "cpu" to exercise the fast path with a fake kernel.
FAST_DEVICE_TYPES = {"cuda"}

TORCH = "torch"


@dataclass(frozen=True)
class KernelOp:
    """One op of a modeling module: its torch fallback and, when transformers bound one, the package kernel.

    `fast` is transformers' own wrapper (kwargs filtering, export guard) around the package
    function; `package` names the package ("fla", "causal_conv1d", "mamba_ssm"), or "torch".
    """

    name: str
    torch_fn: Callable
    fast: Callable | None
    package: str


class DeviceDispatch:
    """Stands in the modeling module for one op: the package kernel on fast devices, the torch fallback elsewhere."""

    def __init__(self, op: KernelOp):
        self.op = op
        functools.update_wrapper(self, op.torch_fn)  # name, docstring; __wrapped__ = the torch function

    def choose(self, device: torch.device | str) -> str:
        return self.op.package if torch.device(device).type in FAST_DEVICE_TYPES else TORCH

    def __call__(self, *args, **kwargs):
        device = _first_tensor_device(args, kwargs)
        if device is not None and device.type in FAST_DEVICE_TYPES:
            return self.op.fast(*args, **kwargs)
        return self.op.torch_fn(*args, **kwargs)


class KernelSelection:
    """The ops of one modeling module that transformers may bind to a package kernel, and what each runs.

    Immutable after construction; `install` mutates the modeling module (once: it is idempotent).
    A `PatchPoint` dispatcher already in the module is looked through: what is read and replaced
    is the function it falls back to.
    """

    def __init__(self, module: ModuleType | None, names: tuple[str, ...] = ()):
        self.module = module
        self.ops: dict[str, KernelOp] = {}
        for name in names:
            if module is not None and hasattr(module, name):
                self.ops[name] = resolve(name, getattr(module, name))

    @classmethod
    def install(cls, module: ModuleType | None, names: tuple[str, ...]) -> "KernelSelection":
        """Read `module`'s ops and put a `DeviceDispatch` in front of each one bound to a package kernel.

        Mutates `module` (process-wide) only when a package kernel is present; calling it again is a no-op.
        """
        selection = cls(module, names)
        for name, op in selection.ops.items():
            if op.fast is not None and not isinstance(unpatched(module, name), DeviceDispatch):
                set_unpatched(module, name, DeviceDispatch(op))
        return selection

    def implementation(self, name: str, device: torch.device | str) -> str:
        """What a call of op `name` on a tensor on `device` runs: "torch" or the package name."""
        op = self.ops[name]
        if op.fast is None or torch.device(device).type not in FAST_DEVICE_TYPES:
            return TORCH
        return op.package

    def plan(self, device: torch.device | str) -> dict[str, str]:
        """`implementation` of every op on `device`, by op name (empty: the family has no replaceable op)."""
        return {name: self.implementation(name, device) for name in self.ops}

    def fallback(self, name: str) -> Callable:
        """The torch fallback of op `name`: what the adapters' wrappers call."""
        return self.ops[name].torch_fn

    def torch_patches(self) -> dict[tuple[Any, str], Callable]:
        """(module, name) -> torch fallback for every op: applied for a forward, it runs no package kernel."""
        return {(self.module, name): op.torch_fn for name, op in self.ops.items()}

    @contextlib.contextmanager
    def torch_only(self) -> Iterator[None]:
        """Run every op on its torch fallback inside the block, on the calling thread only (`patched`)."""
        with patched(self.torch_patches()):
            yield


def resolve(name: str, fn: Callable) -> KernelOp:
    """Split a modeling-module attribute as transformers built it into (torch fallback, package kernel).

    transformers' wrapper keeps the torch function as `__wrapped__` and its choice in the closure
    variable `implementation`; an attribute that is neither is taken to be torch code. A `PatchPoint`
    dispatcher stands for the function it falls back to.
    """
    point = getattr(fn, "patch_point", None)
    if isinstance(point, PatchPoint):
        fn = point.original
    if isinstance(fn, DeviceDispatch):
        return fn.op
    torch_fn = inspect.unwrap(fn)
    implementation = torch_fn
    layer: Any = fn
    while layer is not None:
        code = getattr(layer, "__code__", None)
        if code is not None and "implementation" in code.co_freevars:
            implementation = layer.__closure__[code.co_freevars.index("implementation")].cell_contents
            break
        layer = getattr(layer, "__wrapped__", None)
    fallback = _torch_only(name, torch_fn)
    if implementation is torch_fn:
        return KernelOp(name, fallback, None, TORCH)
    package = (getattr(implementation, "__module__", None) or "unknown").split(".")[0]
    return KernelOp(name, fallback, fn, package)


def _torch_only(name: str, torch_fn: Callable) -> Callable:
    """`torch_fn` as transformers calls it when no package is installed: packed sequences refused, extra kwargs dropped."""
    params = inspect.signature(torch_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(torch_fn)
    def fallback(*args, **kwargs):
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"the torch fallback of {name} cannot keep packed sequences apart")
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_fn(*args, **kwargs)

    return fallback


# --- patches per thread -----------------------------------------------------------------------------
_INSTALL_LOCK = threading.Lock()  # one dispatcher per attribute, however many threads patch it first


class PatchPoint:
    """One attribute of a module (or class) that patches replace for the calling thread only.

    Why threads: the adapters replace a modeling module's ops for the length of a `with` block
    (capture, fused capture, stitch, `torch_only`). Swapping the module attribute itself is
    process-wide, and two threads running patched forwards at once (two engines in one process, an
    engine's background entry computation beside its foreground thread, a training process)
    interleave their save/restore pairs: A saves the original and installs its wrapper, B saves A's
    wrapper as its "original", A restores, B restores A's wrapper, which then stays installed with
    its finished call's capture (IndexError in a later forward), and a forward running meanwhile
    records into the other call's capture.

    So the attribute is replaced once, for good, by `dispatch`, which calls the innermost patch
    active on the calling thread (`push`/`pop`, a `threading.local` stack), else `original`. No
    attribute changes per call. A patch that calls the attribute it replaces (having read it before
    its block, as `LightningAdapter._capture_patches` does) gets the next patch out, or the
    original: what the attribute held when it read it. `dispatch` is a plain function, so on a class
    it binds as a method: a class attribute patched this way must be an instance method (`forward`).
    """

    def __init__(self, owner: Any, name: str):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self._local = threading.local()

        def dispatch(*args, **kwargs):
            return self(*args, **kwargs)

        functools.update_wrapper(dispatch, self.original, updated=())  # __wrapped__: unwrap reaches the torch code
        dispatch.patch_point = self  # type: ignore[attr-defined]
        self.dispatch = dispatch
        setattr(owner, name, dispatch)

    @classmethod
    def of(cls, owner: Any, name: str) -> "PatchPoint":
        """The point of `owner.name`, installing its dispatcher on first use (or when something else,
        e.g. a test's monkeypatch, has replaced it since)."""
        with _INSTALL_LOCK:
            point = getattr(getattr(owner, name), "patch_point", None)
            return point if isinstance(point, PatchPoint) and point.owner is owner else cls(owner, name)

    def _stack(self) -> list[Callable]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, fn: Callable) -> None:
        self._stack().append(fn)

    def pop(self, fn: Callable) -> None:
        """Remove the innermost `fn` this thread pushed (blocks may end out of order, e.g. in generators)."""
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is fn:
                del stack[i]
                return

    def active(self) -> tuple[Callable, ...]:
        """The patches active on the calling thread, outermost first."""
        return tuple(self._stack())

    def __call__(self, *args, **kwargs):
        local = self._local
        stack = self._stack()
        depth = getattr(local, "depth", None)  # set while a patch runs: calls it makes go one level out
        level = len(stack) if depth is None else depth
        if level == 0:
            return self.original(*args, **kwargs)
        local.depth = level - 1
        try:
            return stack[level - 1](*args, **kwargs)
        finally:
            local.depth = depth


@contextlib.contextmanager
def patched(patches: dict[tuple[Any, str], Callable]) -> Iterator[None]:
    """Make `owner.name` run `fn` for each (owner, name) -> fn, inside the block and on the calling thread only."""
    pushed: list[tuple[PatchPoint, Callable]] = []
    try:
        for (owner, name), fn in patches.items():
            point = PatchPoint.of(owner, name)
            point.push(fn)
            pushed.append((point, fn))
        yield
    finally:
        for point, fn in reversed(pushed):
            point.pop(fn)


def unpatched(owner: Any, name: str) -> Any:
    """`owner.name` as it is without patches: the function its `PatchPoint` dispatcher falls back to."""
    attr = getattr(owner, name)
    point = getattr(attr, "patch_point", None)
    return point.original if isinstance(point, PatchPoint) and point.owner is owner else attr


def set_unpatched(owner: Any, name: str, fn: Callable) -> None:
    """Replace what `owner.name` runs without patches (behind its dispatcher, if it has one)."""
    with _INSTALL_LOCK:
        point = getattr(getattr(owner, name), "patch_point", None)
        if isinstance(point, PatchPoint) and point.owner is owner:
            point.original = point.dispatch.__wrapped__ = fn  # type: ignore[attr-defined]
        else:
            setattr(owner, name, fn)


def _first_tensor_device(args, kwargs) -> torch.device | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


__all__ = ["DeviceDispatch", "FAST_DEVICE_TYPES", "KernelOp", "KernelSelection", "PatchPoint", "patched", "resolve",
           "set_unpatched", "unpatched"]
