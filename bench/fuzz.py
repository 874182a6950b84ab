"""A long fuzzing run of the gateway's API: tests/gateway/test_gateway_fuzz.py with more examples, a
seed of your choice (a new one by default) and the coverage phase (boundary values of every
field), reporting every distinct failure with a curl command that reproduces it.

    python bench/fuzz.py                        # 300 examples per operation, a fresh seed
    python bench/fuzz.py --examples 1000 --seed 7 --operation "chat"
    python bench/fuzz.py --strict               # known findings too (test_gateway_fuzz.KNOWN)
    python bench/fuzz.py --shrink               # stop at each operation's first failure, minimised

The server is the suite's: a tiny random engine and a hashing-embedder index, on a real uvicorn.
Needs the dev extra (schemathesis, hypothesis). Exit status: pytest's (0: nothing found).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=300, help="examples per operation and generation phase")
    parser.add_argument("--seed", type=int, default=None, help="default: a new one, printed")
    parser.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases")
    parser.add_argument("--operation", default=None, help="only operations whose label contains this (pytest -k)")
    parser.add_argument("--strict", action="store_true", help="do not skip the known findings")
    parser.add_argument("--shrink", action="store_true", help="stop each operation at its first failure and minimise it")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    env = {**os.environ, "HYPIC_FUZZ_EXAMPLES": str(args.examples), "HYPIC_FUZZ_SEED": str(seed),
           "HYPIC_FUZZ_PHASES": args.phases, "HYPIC_FUZZ_COLLECT": "0" if args.shrink else "1",
           "HYPIC_FUZZ_STRICT": "1" if args.strict else "0"}
    selected = "every_operation" + ("" if args.shrink else " or collected")
    if args.operation:
        selected = f"({selected}) and ({args.operation} or collected)"
    command = [sys.executable, "-m", "pytest", "tests/gateway/test_gateway_fuzz.py", "-q", "-p", "no:cacheprovider", "-k", selected]
    print(f"seed {seed}: {args.examples} examples per operation, phases {args.phases}"
          f"{', strict' if args.strict else ''}; rerun with --seed {seed}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(command, cwd=ROOT, env=env)
    print(f"seed {seed}: {'nothing found' if code == 0 else 'failures above'} in {time.perf_counter() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
