"""The ``tigon`` command: ``tigon check | bench | demo | export-kernels``; each takes ``--help``.

Bare ``tigon`` prints the help and exits 0, as ``pip`` does (``git`` prints its usage and exits
1): asking the command what it does is not an error. An unknown command is one (exit 2).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path


def _check(argv: list[str]) -> int:
    from tigon.check import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from tigon.bench import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from tigon.demo import main

    return main(argv)


def export_kernels_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tigon export-kernels",
        description="Write tigon as a kernel repository for transformers' kernel hub (the `kernels` library).",
    )
    parser.add_argument("directory", type=Path, help="where to write it (created if missing)")
    return parser


def _export_kernels(argv: list[str]) -> int:
    directory = export_kernels_parser().parse_args(argv).directory
    from tigon.transformers.kernel_hub import export_kernels

    path = export_kernels(directory)
    print(f"wrote {path}; use it with tigon.transformers.kernel_config({str(path)!r})")
    return 0


COMMANDS = {
    "check": (_check, "every public op in fp32 and bf16 against its reference (environment, errors, time)"),
    "bench": (_bench, "benchmarks against PyTorch, torch.compile and the peers; bench e2e, bench moe, bench longctx"),
    "demo": (_demo, "train a small Llama plain and patched by tigon; compare the losses (and speed, memory on a GPU)"),
    "export-kernels": (_export_kernels, "write tigon as a kernel repository for transformers' kernel hub"),
}


# The libraries tigon integrates with, whose versions a bug report needs: read from the installed
# distributions' metadata, so that none of them is imported (transformers alone takes seconds).
INTEGRATIONS = ("transformers", "peft", "trl", "accelerate", "deepspeed", "torchao", "bitsandbytes")


def version_line() -> str:
    """tigon's version and folder with Python's, torch's and triton's versions, then on a second
    line those of the libraries tigon integrates with (or "not installed")."""
    import torch
    import triton

    import tigon
    from tigon._versions import installed_version

    integrations = ", ".join(f"{name} {installed_version(name) or 'not installed'}" for name in INTEGRATIONS)
    return (
        f"tigon {tigon.__version__} from {Path(tigon.__file__).parent} "
        f"(python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__})\n"
        f"with {integrations}"
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tigon",
        description="tigon: Triton kernels for LLM training. `tigon <command> --help` lists a command's options.",
    )
    parser.add_argument(
        "--version", action="store_true",
        help="print tigon's version, where it is installed and the versions of what it runs with (for a bug report)",
    )
    # The commands parse their own arguments: here they are listed, with what each does.
    commands = parser.add_subparsers(title="commands", dest="command", metavar="<command>")
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    top = parser()
    args = top.parse_args(argv)
    if args.version:
        print(version_line())
    else:
        top.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
