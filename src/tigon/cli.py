"""The ``tigon`` command: ``tigon check | bench | demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tigon", description="tigon: Triton kernels for LLM training")
    parser.add_argument("command", choices=["check", "bench"], help="check: every op against its reference; bench: benchmarks")
    args, rest = parser.parse_known_args(argv)
    if args.command == "check":
        if rest:
            parser.error(f"check takes no arguments, got {' '.join(rest)}")
        from tigon.check import main as check_main

        return check_main()
    from tigon.bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
