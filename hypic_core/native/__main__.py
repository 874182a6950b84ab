"""python -m hypic_core.native build [--dir DIR] [--variants all|native|NAME,...]

Builds the kernel library per ISA variant into DIR (default: $HYPIC_KERNELS_DIR or
~/.cache/hypic/kernels), each beside its manifest (size, sha256), and loads each one this CPU runs to
check its symbols. `native`: the best variant for this CPU; `all`: every variant (an image built on one
machine and run on another picks among them at load). Exit 1 when a build fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import library


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hypic_core.native", description=__doc__.split("\n\n")[1])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the kernel library variants")
    b.add_argument("--dir", type=Path, default=None, help="kernels directory (default: HYPIC_KERNELS_DIR or ~/.cache/hypic/kernels)")
    b.add_argument("--variants", default="native", help="all, native (this CPU's best) or a comma list of "
                                                        f"{', '.join(library.BY_NAME)}")
    b.add_argument("--compiler", default=None, help="C++ compiler (default: $CXX, g++, c++, clang++)")
    args = ap.parse_args(argv)

    root = args.dir or library.cache_dir()
    if args.variants == "all":
        variants = list(library.VARIANTS)
    elif args.variants == "native":
        variants = [library.pick()]
    else:
        unknown = [n for n in args.variants.split(",") if n not in library.BY_NAME]
        if unknown:
            ap.error(f"--variants: unknown {', '.join(unknown)}; use all, native or {', '.join(library.BY_NAME)}")
        variants = [library.BY_NAME[n] for n in args.variants.split(",")]
    compiler = args.compiler or library.find_compiler()
    if compiler is None:
        print("no C++ compiler found (set CXX, or install g++)", file=sys.stderr)
        return 1
    failed = 0
    for v in variants:
        try:
            path = library.build(root, v, compiler)
            _, manifest = library.verified_bytes(root, v)
            runs = not library.missing_flags(v)
            if runs:
                library.load(root, v)  # the symbols and ABI, where this CPU can load it
            print(json.dumps({"variant": v.name, "library": str(path), "sha256": manifest["sha256"],
                              "size": manifest["size"], "loaded": runs}))
        except (library.Untrusted, RuntimeError, OSError) as exc:
            print(f"variant {v.name}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
