"""The native decode kernels: C++17 sources (linear.cpp, ops.cpp, simd.h, hypic_kernels.h) built once per
ISA variant and loaded only after their checks (library.py), and their typed Python face
(decode_matmul.py: `NativeMatmul`, `native()`, `kernel_status()`), which the runner's `NativeOps`
(hypic_core/runner/ops.py) calls. `python -m hypic_core.native build` builds them ahead of time (the
Docker image does). Not decode logic: a C++ library built, checked, loaded and bound, kept apart from
the runner, which decides what to call."""
