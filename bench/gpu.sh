#!/usr/bin/env bash
# The serving load benchmark (bench/serve.py) on a CUDA machine, end to end in under 8 minutes.
#
#   bench/gpu.sh OUTDIR
#
# 1. creates a virtual environment ($VENV, default .venv-gpu; uv when installed, else venv + pip)
#    and installs the project into it: `pip install -e .` resolves the pinned torch==2.13.0 to
#    the CUDA wheel of the default index (PyPI's Linux wheels are CUDA builds). If the index
#    configured here serves a CPU wheel, set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128)
#    and torch is installed from there first. SKIP_INSTALL=1 uses an existing $VENV as it is
#    (a machine without a package index);
# 2. checks that torch sees a GPU;
# 3. builds the bench model (bench/make_bench_model.py: random-init 8-layer qwen3_5, width 512);
# 4. runs bench/serve.py with HYPIC_DEVICE=cuda: every mode, Poisson rates $RATES (default 2 4 8),
#    then decode scaling (1 vs 8 streams), bounded by $BENCH_TIMEOUT seconds (default 330);
#    before it, bench/gpu_kernels.py (exactness on CUDA with torch and fla kernels; KERNEL_CHECK=0 skips).
#
# OUTDIR gets: results.json (every number; rewritten after each cell, so a run cut short keeps
# what it measured), serve_ttft_vs_rate.png, serve.md (the docs/benchmarks.md section),
# serve.log (progress and tables), gpu.txt (nvidia-smi), install.log, bench-model/.
# Other knobs: PYTHON (interpreter for the venv), SLO_MS (p95 TTFT target, default 500),
# NUM_REQUESTS (per cell, default 40), DURATION (seconds of arrivals per cell, default 10),
# HYPIC_CACHE_DEVICE_BYTES (GPU tier of the segment cache, default 8 GiB), HYPIC_TORCH_THREADS
# (default 4), EXTRA_ARGS (more bench/serve.py options, e.g. "--search --search-start 4" for each
# mode's sustainable rate found by search); any other HYPIC_* variable reaches the gateways.
set -euo pipefail

OUT="${1:?usage: bench/gpu.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
VENV="${VENV:-$ROOT/.venv-gpu}"
PY="${PYTHON:-python3}"
RATES="${RATES:-2 4 8}"
START=$SECONDS
log() { echo "[gpu.sh +$((SECONDS - START))s] $*" >&2; }

cd "$ROOT"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" >&2
fi

install() {
    if command -v uv >/dev/null; then
        [ -x "$VENV/bin/python" ] || uv venv -q -p "$PY" "$VENV"
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            uv pip install -q -p "$VENV/bin/python" --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
        fi
        uv pip install -q -p "$VENV/bin/python" -e ".[gpu]"
    else
        [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            "$VENV/bin/python" -m pip install -q --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
        fi
        "$VENV/bin/python" -m pip install -q -e ".[gpu]"
    fi
}

if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    log "SKIP_INSTALL=1: using $VENV as it is"
else
    log "installing the project into $VENV (log: $OUT/install.log)"
    install >"$OUT/install.log" 2>&1 || { tail -n 30 "$OUT/install.log" >&2; log "install failed"; exit 1; }
fi

"$VENV/bin/python" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: a CPU wheel or no driver; "
             "set TORCH_INDEX_URL to a CUDA wheel index and rerun")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", file=sys.stderr)
EOF

export HYPIC_DEVICE="${HYPIC_DEVICE:-cuda}"
export HYPIC_TORCH_THREADS="${HYPIC_TORCH_THREADS:-4}"
export HYPIC_CACHE_DEVICE_BYTES="${HYPIC_CACHE_DEVICE_BYTES:-$((8 << 30))}"
export TOKENIZERS_PARALLELISM=false

if [ "${KERNEL_CHECK:-1}" = 1 ]; then
    # The adapters' exactness checks on CUDA, torch fallbacks and (when installed: the gpu extra)
    # fla kernels, and fla's prefill speed-up (docs/gpu.md). First use compiles Triton kernels.
    log "running bench/gpu_kernels.py (at most ${KERNEL_TIMEOUT:-600} s; KERNEL_CHECK=0 skips it)"
    timeout "${KERNEL_TIMEOUT:-600}" "$VENV/bin/python" bench/gpu_kernels.py 2>&1 | tee "$OUT/kernels.log" \
        || log "kernel check failed or timed out (see $OUT/kernels.log)"
fi

log "building the bench model"
HF_HUB_DISABLE_PROGRESS_BARS=1 "$VENV/bin/python" bench/make_bench_model.py "$OUT/bench-model" >&2

log "running bench/serve.py (rates: $RATES; at most ${BENCH_TIMEOUT:-330} s)"
# shellcheck disable=SC2086  # RATES is a list of numbers, EXTRA_ARGS a list of options
timeout "${BENCH_TIMEOUT:-330}" "$VENV/bin/python" bench/serve.py \
    --model "$OUT/bench-model" --rates $RATES \
    --num-requests "${NUM_REQUESTS:-40}" --duration "${DURATION:-10}" --warmup 10 \
    --slo-ttft-ms "${SLO_MS:-500}" --decode-scaling \
    --out "$OUT/results.json" --plot "$OUT/serve_ttft_vs_rate.png" --markdown "$OUT/serve.md" \
    ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/serve.log"
log "done: results in $OUT"
