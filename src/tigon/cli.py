"""The ``tigon`` command: ``tigon check | bench | demo``; each takes ``--help``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tigon", description="tigon: Triton kernels for LLM training")
    parser.add_argument(
        "command", choices=["check", "bench", "demo"],
        help="check: every op against its reference; bench: benchmarks; demo: train a small Llama plain and patched",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "check":
        if rest:
            parser.error(f"check takes no arguments, got {' '.join(rest)}")
        from tigon.check import main as check_main

        return check_main()
    if args.command == "demo":
        from tigon.demo import main as demo_main

        return demo_main(rest)
    from tigon.bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
