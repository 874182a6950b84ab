"""The native decode kernels: C++17 sources (linear.cpp, ops.cpp, simd.h, hypic_kernels.h) built once per
ISA variant and loaded only after their checks (library.py); hypic_core/runner/decode_matmul.py calls
them. `python -m hypic_core.native build` builds them ahead of time (the Docker image does).
Not decode logic: how a native library is built, checked and loaded, kept apart from the runner."""
