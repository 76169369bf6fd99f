"""Runs examples/train_fsdp2.py several times in the processes of one launch (torchrun, or plain
python for one process), sharing one process group and one import of everything.

    python run_example.py RUNS.json OUT_DIR      RUNS.json: {"name": [argument, ...], ...}

Each run writes ``OUT_DIR/<name>.json`` (the example's ``--losses-out``).
"""

import gc
import json
import os
import sys
from pathlib import Path

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def without_deepspeed_shared_memory_op():
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (a C++ extension) on first use:
    a minute and a half on two cores, for a speed-up a tiny model never sees, and its threads
    sometimes abort the process at exit. gloo does the same job."""
    try:
        import deepspeed.comm.torch as deepspeed_comm
    except ImportError:
        return
    deepspeed_comm.build_shm_op = lambda: None


def main():
    runs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    without_deepspeed_shared_memory_op()
    sys.path.insert(0, str(EXAMPLES))
    import train_fsdp2

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("gloo")
    for name, arguments in runs.items():
        train_fsdp2.main([*arguments, "--losses-out", str(out / f"{name}.json")])
    if dist.is_initialized():
        gc.collect()  # the engines hold the group: let go of them everywhere first
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
