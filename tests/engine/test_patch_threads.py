"""Patched forwards on several threads at once (hypic_core/adapters/kernels.py `PatchPoint`, `patched`).

Capture, fused capture and stitch replace a modeling module's ops for a `with` block. They used to
swap the module attribute itself, process-wide: two threads' save/restore pairs interleaved, a
forward recorded into the other thread's capture, and a finished call's wrapper stayed installed
(a later forward hit IndexError in `conv_wrapper`). Now each attribute is a permanent dispatcher
that resolves the patch per thread.

- A block's patches reach only its own thread; nesting and a patch calling the attribute it
  replaces behave as before (a fake module).
- Thread B enters a capture while A is inside one on the same modeling module, A leaves first:
  each capture records its own forward only, and afterwards no patch is left active anywhere
  (deterministic, with events).
- A kernel selection made with dispatchers in the module looks through them (a fake package).
- Four threads, two Mamba2 and two Gated DeltaNet models, capture, capture bodies and stitch
  over and over at once: every result equals the same work run serially, and a plain forward
  afterwards equals one from before.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

import engines
from hypic_core.adapters import adapter_for
from hypic_core.adapters.kernels import DeviceDispatch, PatchPoint, patched, unpatched
from hypic_core.testing import tiny_model

SEAM = 4
SEGMENTS = ((5, 9, 13, 2, 7, 11, 3), tuple(range(20, 37)), tuple(range(40, 52)), (60, 61, 62, 63, 64))
TIMEOUT = 120  # seconds a thread waits for the other before the test fails instead of hanging


def run_threads(*targets):
    """Run each target on its own thread; re-raise the first exception one of them raised."""
    errors: list[BaseException] = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "the other thread never got there"


def patch_points(adapter, make) -> list[PatchPoint]:
    """The dispatchers behind every attribute `make(cap)` and the torch pinning patch (installed by now)."""
    from hypic_core.adapters.base import Capture

    names = {**adapter.kernels.torch_patches(), **make(Capture())}
    points = [getattr(getattr(owner, name), "patch_point", None) for owner, name in names]
    assert all(isinstance(p, PatchPoint) for p in points), "a patched attribute is not a dispatcher"
    return points


# --- the mechanism, on a fake module -------------------------------------------------------------
def test_patches_reach_their_own_thread_only_and_nest():
    mod = types.ModuleType("fake_modeling")
    mod.op = lambda x: ("original", x)
    original = mod.op

    def outer(x):
        return ("outer", x)

    inner_calls = []
    seen_by_inner = mod.op  # what a patch built before its block reads (LightningAdapter._capture_patches)

    def inner(x):
        inner_calls.append(x)
        return ("inner", seen_by_inner(x))

    entered, checked = threading.Event(), threading.Event()
    other: list = []

    def other_thread():
        wait(entered)
        other.append(mod.op(1))  # main is inside both blocks: this thread sees neither
        checked.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with patched({(mod, "op"): outer}):
        assert mod.op(1) == ("outer", 1)
        seen_by_inner = mod.op  # read inside the outer block: the dispatcher, which goes one level out
        with patched({(mod, "op"): inner}):
            assert mod.op(2) == ("inner", ("outer", 2))
            entered.set()
            wait(checked)
        assert mod.op(3) == ("outer", 3)
    t.join(TIMEOUT)
    assert other == [("original", 1)]
    assert inner_calls == [2]
    assert mod.op(4) == ("original", 4)
    point = mod.op.patch_point
    assert point.original is original and point.active() == ()
    with patched({(mod, "op"): outer}):  # the same dispatcher again: installed once
        assert mod.op.patch_point is point and mod.op(5) == ("outer", 5)


def test_blocks_ending_out_of_order_on_one_thread_leave_nothing_behind():
    """Generator-held blocks may end in any order; each removes its own patch."""
    mod = types.ModuleType("fake_modeling")
    mod.op = lambda: "original"
    a, b = patched({(mod, "op"): lambda: "a"}), patched({(mod, "op"): lambda: "b"})
    a.__enter__()
    b.__enter__()
    assert mod.op() == "b"
    a.__exit__(None, None, None)
    assert mod.op() == "b"
    b.__exit__(None, None, None)
    assert mod.op() == "original"


def test_kernel_selection_looks_through_the_dispatchers(monkeypatch):
    """With a package kernel bound (faked as in test_kernel_selection.py) and the dispatchers of an
    earlier capture in front of the ops, a new adapter still finds the kernel, and its selection
    stays behind the dispatchers (installed once, not stacked)."""
    from test_kernel_selection import fake_packages

    model = tiny_model("qwen3_5")
    module, ops = adapter_for(model)._modeling, type(adapter_for(model)).kernel_ops
    fake_packages(monkeypatch, module, ops)
    first = adapter_for(model)
    with first.capture():
        pass
    again = adapter_for(model)
    assert again.kernel_plan("cuda") == first.kernel_plan("cuda") != again.kernel_plan("cpu")
    for name in ops:
        assert isinstance(getattr(module, name).patch_point, PatchPoint)
        behind = unpatched(module, name)
        assert isinstance(behind, DeviceDispatch) and not isinstance(behind.op.fast, DeviceDispatch)


# --- interleaved captures on one modeling module --------------------------------------------------
def capture_forward(adapter, model, segment):
    """A plain forward over `segment` on a fresh cache (inside whatever block the caller holds)."""
    ids = torch.tensor([segment])
    model.base_model(input_ids=ids, position_ids=torch.arange(len(segment))[None], cache=adapter.new_cache(),
                     use_cache=True)


def operators(adapter, cap, n):
    return [(op.transition.clone(), op.end.clone()) for op in adapter.span_operators(cap, 0, SEAM, n)]


def assert_same(ref, out, what):
    assert len(ref) == len(out), what
    for r, o in zip(ref, out):
        if isinstance(r, (tuple, list)):
            assert_same(r, o, what)
        else:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_capture_entered_while_another_thread_is_inside_one(family):
    """B enters its capture while A is inside its own (same modeling module); A runs its forward
    while B's block is open, then leaves first; B runs its forward after A left. The old code
    recorded A's forward into B's capture and left A's wrapper installed for good."""
    models = [tiny_model(family, seed=s) for s in (0, 1)]
    adapters = [adapter_for(m) for m in models]
    seg = SEGMENTS[1]
    with torch.inference_mode():
        before = models[0](input_ids=torch.tensor([seg])).logits
        serial = []
        for adapter, model in zip(adapters, models):
            with adapter.capture(0, len(seg)) as cap:
                capture_forward(adapter, model, seg)
            serial.append(operators(adapter, cap, len(seg)))

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    caps: dict[str, object] = {}
    active_after: dict[str, list] = {}

    def thread_a():
        adapter, model = adapters[0], models[0]
        with torch.inference_mode():
            with adapter.capture(0, len(seg)) as cap:
                a_in.set()
                wait(b_in)
                capture_forward(adapter, model, seg)
            caps["a"] = cap
            active_after["a"] = [p.active() for p in patch_points(adapter, adapter._capture_patches)]
            a_out.set()

    def thread_b():
        adapter, model = adapters[1], models[1]
        wait(a_in)
        with torch.inference_mode():
            with adapter.capture(0, len(seg)) as cap:
                b_in.set()
                wait(a_out)
                capture_forward(adapter, model, seg)
            caps["b"] = cap
            active_after["b"] = [p.active() for p in patch_points(adapter, adapter._capture_patches)]

    run_threads(thread_a, thread_b)
    n_linear = len(adapters[0].linear_layers)
    for key in ("a", "b"):
        assert len(caps[key].conv_inputs) == n_linear, f"{key}'s capture recorded another forward"
        assert all(not stack for stack in active_after[key]), f"{key}'s patches outlived its block"
    with torch.inference_mode():
        for key, adapter, ref in zip("ab", adapters, serial):
            assert_same(ref, operators(adapter, caps[key], len(seg)), f"{key}'s operators")
        for p in patch_points(adapters[0], adapters[0]._capture_patches):  # the module holds dispatchers, idle here
            assert p.active() == ()
        after = models[0](input_ids=torch.tensor([seg])).logits  # a plain forward: no capture records it
    assert len(caps["a"].conv_inputs) == n_linear and len(caps["b"].conv_inputs) == n_linear
    assert torch.equal(after, before)


# --- many patched forwards at once ------------------------------------------------------------------
def work(engine, rounds):
    """Capture, fused body (where the family has one) and stitch `rounds` times; every result, in order."""
    adapter, runner = engine.adapter, engine.runner
    context, question = list(SEGMENTS[:-1]), SEGMENTS[-1]
    out = []
    with torch.inference_mode():
        for _ in range(rounds):
            seg = SEGMENTS[1]
            with adapter.capture(0, len(seg)) as cap:
                capture_forward(adapter, engine.model, seg)
            out.append(operators(adapter, cap, len(seg)))
            entries = runner.compute_entries(context, SEAM, 4096)  # fused body capture for Gated DeltaNet
            out.append([[op.transition, op.end] for e in entries for op in e.operators])
            out.append(runner.stitch(runner.new_cache(), context, entries, question))
    return out


def test_two_families_capture_and_stitch_on_four_threads_as_they_do_serially():
    """Two models of each family, one thread each: the threads of a family patch the same modeling
    module. The GIL switches threads every 10 us here, so blocks overlap all the time."""
    threads = [("bamba", 3), ("bamba", 4), ("qwen3_5", 3), ("qwen3_5", 4)]
    eng = {key: engines.engine(SEAM, model=tiny_model(*key)) for key in threads}
    seg = SEGMENTS[2]
    with torch.inference_mode():
        before = {key: e.model(input_ids=torch.tensor([seg])).logits for key, e in eng.items()}
    serial = {key: work(e, 1) for key, e in eng.items()}
    rounds = 4
    results: dict[tuple, list] = {}
    start = threading.Barrier(len(threads), timeout=TIMEOUT)

    def run(key):
        def go():
            start.wait()
            results[key] = work(eng[key], rounds)
        return go

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        run_threads(*(run(key) for key in threads))
    finally:
        sys.setswitchinterval(interval)
    for key in threads:
        assert len(results[key]) == 3 * rounds
        for i, got in enumerate(results[key]):
            assert_same([serial[key][i % 3]], [got], f"{key} result {i}")
    with torch.inference_mode():
        for key, e in eng.items():
            assert all(p.active() == () for p in patch_points(e.adapter, e.adapter._capture_patches))
            assert torch.equal(e.model(input_ids=torch.tensor([seg])).logits, before[key])
