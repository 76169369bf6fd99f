"""Past one GPU: tigon's vocabulary-parallel loss, and models trained under transformers' tensor and
expert parallelism, against what PyTorch and Hugging Face run there.

``tigon bench parallel`` runs three benchmarks (``--what``), each on ``--tp`` GPUs of one host
(torchrun; NCCL, gloo on the CPU with ``--smoke``), every rank reporting, the slowest rank's time
and the largest peak kept:

- ``loss``: the head's loss at N 8192 tokens, H 4096, V 128256 (Llama-3), bf16, forward +
  backward, timed per GPU with the head sharded along the vocabulary over the ranks (``torch.chunk``'s
  split, DTensor's): tigon's vocabulary-parallel fused linear cross entropy (``process_group=``),
  and PyTorch's ``loss_parallel`` over the materialised logits (``x @ W_r.T``, a DTensor placed
  ``Shard(-1)``, cast to fp32 as torchtitan does). For scale, each rank also times tigon's fused
  loss over the whole head on its own GPU. Checked on every rank: the sharded loss and the input's and
  the slice's gradients against the whole head's on one GPU (bf16: ~1e-3 relative), and the loss
  against the fp32 reference.
- ``tp``: 8 layers of Llama-3-8B loaded with ``from_pretrained(..., tp_plan="auto")``
  (transformers' own plan: q, k, v, gate, up column-parallel, o, down row-parallel, the head's
  logits gathered), trained by Hugging Face alone (``hf``) and after ``apply_tigon(model)``
  (``tigon``: its norms, RoPE and SwiGLU on the plan's shards, the loss vocabulary-parallel on the
  sharded head). Every rank trains on the same batch (tensor parallelism splits the model, not the
  data), 4 × 4096 tokens a step; tokens/s per GPU are the step's tokens over its time (the slowest
  rank's) and the GPUs.
- ``ep``: 4 layers of Qwen3-30B-A3B with its 128 experts spread over the GPUs by transformers'
  expert parallelism (``DistributedConfig(enable_expert_parallel=True)``), its experts on
  transformers' ``grouped_mm`` (``hf``) or tigon's kernel with ``apply_tigon`` for the rest
  (``tigon``). The rest of the model is replicated, and every rank runs every token (transformers
  sums the ranks' expert outputs): the same batch on every rank, as for ``tp``.

For ``tp`` and ``ep`` the model's seeded random weights are saved once to a checkpoint that every
setup loads; both setups train on the same batches, and each records every step's loss and its
first loss's relative difference from Hugging Face's (bf16: ~1e-2 at most). Non-reentrant gradient
checkpointing, SDPA, fused AdamW (lr 1e-5; the DTensor parameters and the plain ones in two groups).

Writes ``parallel_<what>.json`` per benchmark, rewritten after each process, into ``--out``
(default: ``tigon-out/bench-<gpu>``; ``tigon-out/bench-smoke`` with ``--smoke``, which runs tiny
shapes in fp32 on the CPU through Triton's interpreter and times nothing).

    tigon bench parallel [--what loss tp ep] [--tp 2 4] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tigon.bench.e2e import time_steps, train_step
from tigon.bench.e2e_models import MODELS, build_model, experts_in, text_batch
from tigon.bench.machine import default_out, environment, peak_gib, reset_peak, synchronize
from tigon.bench.processes import failure_record, launch, print_result

WHAT = ("loss", "tp", "ep")
SETUPS = {"loss": ("tigon", "loss_parallel"), "tp": ("hf", "tigon"), "ep": ("hf", "tigon")}
LOSS_SHAPE = dict(tokens=8192, hidden=4096, vocab=128256)
SMOKE_LOSS_SHAPE = dict(tokens=48, hidden=32, vocab=203)
MODEL = {"tp": ("llama", 8), "ep": ("qwen3_moe", 4)}
TRAIN = dict(batch=4, seq_len=4096, warmup=2, steps=6)
SMOKE_TRAIN = dict(batch=2, seq_len=32, warmup=1, steps=2)
LOSS_CALLS = dict(warmup=3, timed=10)
TIMEOUT_S = 900


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _relative(value: torch.Tensor, truth: torch.Tensor) -> float:
    return ((value.float() - truth.float()).norm() / truth.float().norm().clamp_min(1e-30)).item()


def _timed_ms(call, device: torch.device, warmup: int, timed: int) -> float:
    """The mean time (ms) of ``call`` after ``warmup`` calls, every rank starting together."""
    for _ in range(warmup):
        call()
    synchronize(device.type)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(timed):
        call()
    synchronize(device.type)
    return (time.perf_counter() - start) / timed * 1e3


def _peak_extra_gib(call, device: torch.device) -> float | None:
    """The memory one ``call`` allocates beyond what is already held (``None`` on the CPU)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    reset_peak("cuda")
    call()
    synchronize("cuda")
    return peak_gib("cuda") - held / 2**30


def run_loss(smoke: bool) -> dict:
    """The ``loss`` benchmark on this rank: times, peaks and errors by provider."""
    import tigon.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from tigon.testing import reference

    shape = SMOKE_LOSS_SHAPE if smoke else LOSS_SHAPE
    device, rank, world = _device(), dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if smoke else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)  # the same tokens and head on every rank
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    x = (torch.randn(n, h, device=device, generator=generator) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=generator) * h**-0.5).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=generator)
    target[: n // 8] = -100  # a prompt's worth of ignored tokens
    sizes = [len(rows) for rows in torch.arange(v).chunk(world)]
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    shard = weight[start:stop].clone().requires_grad_()
    whole = weight.clone().requires_grad_()
    mesh = init_device_mesh(device.type, (world,))

    def tigon_sharded():
        F.fused_linear_cross_entropy(x, shard, target, process_group=dist.group.WORLD).backward()

    def torch_loss_parallel():
        # The head's global shape given: from_local would take uneven shards for even ones.
        head = DTensor.from_local(shard, mesh, [Shard(0)], shape=(v, h), stride=(h, 1))
        logits = DTensor.from_local(x, mesh, [Replicate()]) @ head.t()
        with loss_parallel():
            torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100).backward()

    def tigon_whole():
        F.fused_linear_cross_entropy(x, whole, target).backward()

    result: dict = {"shape": shape, "shard_rows": stop - start, "providers": {}}
    grads = {}
    for name, call, head in (("tigon", tigon_sharded, shard), ("loss_parallel", torch_loss_parallel, shard),
                             ("tigon_one_gpu", tigon_whole, whole)):
        x.grad, head.grad = None, None
        entry: dict = {}
        try:
            call()
            grads[name] = (x.grad.clone(), head.grad.clone())
            if not smoke:
                entry["time_ms"] = _timed_ms(call, device, **LOSS_CALLS)
                x.grad, head.grad = None, None
                entry["peak_extra_gib"] = _peak_extra_gib(call, device)
        except Exception as error:  # noqa: BLE001  (recorded: out of memory)
            traceback.print_exc()
            entry.update(failure_record(error))
        x.grad, head.grad = None, None
        result["providers"][name] = entry
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with torch.no_grad():
        loss_sharded = F.fused_linear_cross_entropy(x, shard, target, process_group=dist.group.WORLD)
        loss_whole = F.fused_linear_cross_entropy(x, whole, target)
        loss_fp32 = reference.fused_linear_cross_entropy(x.float(), weight.float(), target)
    result["loss"] = loss_sharded.item()
    errors = {"loss_vs_one_gpu": abs(loss_sharded.item() - loss_whole.item()) / abs(loss_whole.item()),
              "loss_vs_fp32_reference": abs(loss_sharded.item() - loss_fp32.item()) / abs(loss_fp32.item())}
    if "tigon_one_gpu" in grads:
        x_whole, w_whole = grads["tigon_one_gpu"]
        for name in ("tigon", "loss_parallel"):
            if name in grads:
                errors[f"{name}_grad_input"] = _relative(grads[name][0], x_whole)
                errors[f"{name}_grad_weight_slice"] = _relative(grads[name][1], w_whole[start:stop])
    result["relative_errors_vs_one_gpu"] = errors
    return result


def save_checkpoint(what: str, directory: str, smoke: bool) -> str:
    """The seeded random model of ``what`` saved to ``directory``: the weights every setup loads."""
    model, layers = MODEL[what]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    built = build_model("hf", 2 if smoke else layers, device, model=model,
                        dtype=torch.float32 if smoke else torch.bfloat16, tiny=smoke)
    built.save_pretrained(directory)
    del built
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


def load_parallel(what: str, setup: str, checkpoint: str, smoke: bool):
    """The checkpoint loaded with ``what``'s parallelism over the process group, patched by tigon
    for the ``tigon`` setup, ready to train (gradient checkpointing, no cache)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from tigon.transformers import apply_tigon

    world = dist.get_world_size()
    options: dict = dict(dtype=torch.float32 if smoke else torch.bfloat16,
                         attn_implementation="eager" if smoke else "sdpa")
    if what == "tp":
        options["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=world)
    else:
        options["distributed_config"] = DistributedConfig(tp_size=world, enable_expert_parallel=True)
        options["experts_implementation"] = "grouped_mm"
        if setup == "tigon":
            from tigon.transformers.moe import IMPLEMENTATION, register

            register()
            options["experts_implementation"] = IMPLEMENTATION
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **options)
    if setup == "tigon":
        apply_tigon(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def new_optimizer(model, fused: bool) -> torch.optim.AdamW:
    """AdamW (lr 1e-5) with the model's DTensor parameters and its plain ones in two groups: a
    plan leaves some parameters plain (norms, the embedding), and one fused or foreach call
    refuses a mix."""
    from torch.distributed.tensor import DTensor

    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if isinstance(p, DTensor) is sharded]} for sharded in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-5, fused=fused, foreach=not fused)


def run_train(what: str, setup: str, checkpoint: str, smoke: bool) -> dict:
    """``setup`` of the ``tp`` or ``ep`` benchmark trained on this rank."""
    sizes = SMOKE_TRAIN if smoke else TRAIN
    device = _device()
    model = load_parallel(what, setup, checkpoint, smoke)
    optimizer = new_optimizer(model, fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(0)  # one batch for the whole group

    def step(phase_peaks=None):
        return train_step(model, optimizer, text_batch(model.config, sizes["batch"], sizes["seq_len"], generator),
                          phase_peaks)

    tokens = sizes["batch"] * sizes["seq_len"]
    measured = time_steps(step, tokens, sizes["warmup"], sizes["steps"], device.type, step)
    measured["tokens_per_second"] /= dist.get_world_size()
    return {"experts": experts_in(model), **measured}


def run_child(args) -> int:
    """One process (rank) of a launch: its benchmark, the ranks' results gathered, rank 0 prints."""
    device = _device()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    what, setup = args.child
    try:
        if what == "loss":
            mine = run_loss(args.smoke)
        else:
            mine = run_train(what, setup, args.checkpoint, args.smoke)
    except Exception as error:  # noqa: BLE001  (recorded: out of memory, a plan refused)
        traceback.print_exc()
        mine = failure_record(error)
    rank, ranks = dist.get_rank(), [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    # Once every rank has let go of its model and reached here: a gloo group torn down while a peer
    # still uses it aborts the process.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return 0
    print_result(summarize(what, ranks))
    return 0


def summarize(what: str, ranks: list[dict]) -> dict:
    """The ranks' results as one: the slowest rank's time, the largest peak, every rank's own."""
    failed = next((r for r in ranks if "error" in r), None)
    if failed is not None:
        return {**failed, "per_rank": ranks}
    if what == "loss":
        providers = {}
        for name in ranks[0]["providers"]:
            entries = [r["providers"][name] for r in ranks]
            error = next((e for e in entries if "error" in e), None)
            if error is not None:
                providers[name] = error
                continue
            providers[name] = {key: None if None in (values := [e.get(key) for e in entries]) else max(values)
                               for key in ("time_ms", "peak_extra_gib")}
        errors = {key: max(r["relative_errors_vs_one_gpu"][key] for r in ranks)
                  for key in ranks[0]["relative_errors_vs_one_gpu"]}
        return {"shape": ranks[0]["shape"], "loss": ranks[0]["loss"], "providers": providers,
                "relative_errors_vs_one_gpu": errors, "per_rank": ranks}
    peaks = [r["peak_memory_gib"] for r in ranks]
    return {
        "experts": ranks[0]["experts"],
        "tokens_per_second": min(r["tokens_per_second"] for r in ranks),
        "peak_memory_gib": None if None in peaks else max(peaks), "losses": ranks[0]["losses"],
        "per_rank": [{k: r[k] for k in ("tokens_per_second", "peak_memory_gib", "losses")} for r in ranks],
    }


def add_comparisons(what: str, results: list[dict]) -> None:
    """Ratios in place: the loss benchmark's against tigon's one-GPU loss and ``loss_parallel``;
    the training runs' tokens/s, peak and first loss against Hugging Face's at the same size."""
    for result in results:
        if "error" in result:
            continue
        if what == "loss":
            times = {name: entry.get("time_ms") for name, entry in result["providers"].items()}
            if times.get("tigon") and times.get("tigon_one_gpu"):
                result["tigon_vs_one_gpu_time"] = times["tigon"] / times["tigon_one_gpu"]
            if times.get("tigon") and times.get("loss_parallel"):
                result["speedup_vs_loss_parallel"] = times["loss_parallel"] / times["tigon"]
            continue
        base = next((b for b in results if b["setup"] == "hf" and b["tp"] == result["tp"] and "error" not in b), None)
        if base is None or base is result:
            continue
        result["speedup_vs_hf"] = result["tokens_per_second"] / base["tokens_per_second"]
        if result["peak_memory_gib"] and base["peak_memory_gib"]:
            result["memory_vs_hf"] = result["peak_memory_gib"] / base["peak_memory_gib"]
        first, hf_first = result["losses"][0], base["losses"][0]
        result["first_loss_rel_diff_vs_hf"] = abs(first - hf_first) / abs(hf_first)


def child_command(args, what: str, setup: str, tp: int, checkpoint: str | None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
            "-m", "tigon.bench.parallel", "--child", what, setup, *(["--smoke"] if args.smoke else []),
            *(["--checkpoint", checkpoint] if checkpoint else [])]


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="tigon bench parallel",
        description=__doc__.split("\n\n")[0].replace("\n", " ") + " See python -m pydoc tigon.bench.parallel.",
    )
    parser.add_argument("--what", nargs="+", choices=WHAT, default=list(WHAT), metavar="WHAT",
                        help=f"which benchmarks: {', '.join(WHAT)} (default: all)")
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4], metavar="N",
                        help="GPUs (processes) each benchmark runs on, one launch per count (default: 2 4; "
                        "ep runs on 2 only)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny fp32 shapes, on the CPU (gloo) without a GPU: checks the code paths, times nothing")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help=f"seconds each launch may take (default: {TIMEOUT_S})")
    parser.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu> of the working "
                        "directory; tigon-out/bench-smoke with --smoke)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.tp) < 2:
        parser.error(f"--tp takes counts of at least 2 (one process has nothing to split), got {args.tp}")
    return parser, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse_args(argv)
    if args.child:
        return run_child(args)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("tigon bench parallel runs on GPUs; no CUDA device is available here. "
              "`tigon bench parallel --smoke` runs tiny shapes on the CPU (it times nothing).")
        return 1
    if on_gpu and max(args.tp) > torch.cuda.device_count():
        parser.error(f"--tp {max(args.tp)}: this machine has {torch.cuda.device_count()} GPU(s)")
    device = "cuda" if on_gpu else "cpu"
    out = args.out or default_out(args.smoke, torch.cuda.get_device_name() if on_gpu else None)
    out.mkdir(parents=True, exist_ok=True)
    measured = 0
    with tempfile.TemporaryDirectory() as directory:
        for what in args.what:
            record = {"what": what, "smoke": args.smoke, "environment": environment(device), "results": []}
            checkpoint = None
            if what != "loss":
                checkpoint = save_checkpoint(what, str(Path(directory) / what), args.smoke)
                record["model"] = {"name": MODELS[MODEL[what][0]].title, "layers": MODEL[what][1],
                                   **(SMOKE_TRAIN if args.smoke else TRAIN)}
            # Expert parallel on 2 GPUs only: the target's, and where 128 experts split evenly at any count.
            counts = [2] if what == "ep" else args.tp
            for tp in counts:
                for setup in SETUPS[what] if what != "loss" else ("all",):
                    label = f"{what} {setup} on {tp} {'GPUs' if on_gpu else 'processes'}"
                    print(f"{label} ...", flush=True)
                    result = launch(child_command(args, what, setup, tp, checkpoint), label, args.timeout) or {
                        "error": "its processes failed (see the log)"}
                    result = {"setup": setup, "tp": tp, **result}
                    record["results"].append(result)
                    add_comparisons(what, record["results"])
                    measured += "error" not in result
                    summary = {k: v for k, v in result.items() if k not in ("per_rank", "traceback", "losses")}
                    print(json.dumps(summary), flush=True)
                    (out / f"parallel_{what}.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {', '.join(str(out / f'parallel_{what}.json') for what in args.what)}")
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
