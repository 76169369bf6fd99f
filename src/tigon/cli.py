"""The ``tigon`` command: ``tigon check | bench | demo | export-kernels``; each takes ``--help``."""

from __future__ import annotations

import argparse
import sys


def _check(argv: list[str]) -> int:
    from tigon.check import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from tigon.bench import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from tigon.demo import main

    return main(argv)


def _export_kernels(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tigon export-kernels",
        description="Write tigon as a kernel repository for transformers' kernel hub (the `kernels` library).",
    )
    parser.add_argument("directory", help="where to write it (created if missing)")
    directory = parser.parse_args(argv).directory
    from tigon.transformers.kernel_hub import export_kernels

    path = export_kernels(directory)
    print(f"wrote {path}; use it with tigon.transformers.kernel_config({str(path)!r})")
    return 0


COMMANDS = {
    "check": (_check, "every op against its reference (environment, max errors, time)"),
    "bench": (_bench, "benchmarks against PyTorch, torch.compile and the peers; bench e2e, bench moe"),
    "demo": (_demo, "train a small Llama plain and patched by tigon; compare losses, speed, memory"),
    "export-kernels": (_export_kernels, "write tigon as a kernel repository for transformers' kernel hub"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    parser = argparse.ArgumentParser(prog="tigon", description="tigon: Triton kernels for LLM training")
    parser.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
