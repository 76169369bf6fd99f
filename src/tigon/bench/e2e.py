"""End to end: models trained by Hugging Face, + Liger-Kernel, + tigon; tokens/s and peak memory.

One harness measures every end-to-end number: the models of :mod:`tigon.bench.e2e_models` (Llama-3-8B,
Llama-3.2-1B, Qwen3-30B-A3B, Qwen2.5-VL-7B, DeepSeek-V3 at V2-Lite scale, GPT-OSS-20B: their real
widths, few layers), trained by one of three loops, on one GPU or several under FSDP2.

Each setup runs in its own process (patching is global, and peak memory must start from nothing),
Hugging Face first; each reports tokens/s over the timed steps after the warm-up ones, the peak
memory of a training step and of each of its phases (forward, backward, optimizer), every step's
loss, and how far its first loss is from Hugging Face's (the same weights and batches in every
setup: ~1e-2 relative in bf16). A setup that fails (out of memory, a patch raising) is recorded
with its reason; the others run on. Setups: ``hf`` (nothing patched), ``liger`` (Liger-Kernel's
``MODEL_TYPE_TO_APPLY_LIGER_FN`` entry for the family, its defaults) and ``tigon``
(``tigon.transformers.PATCHERS[model_type]()``), each applied before the model is built.

The loop (default, ``--lora``, ``--budget``, ``--cuda-graph``, ``--gpus``): bf16 weights, AdamW
(PyTorch's fused one by default, as the Hugging Face Trainer uses with torch ≥ 2.8;
``--optimizer foreach`` takes PyTorch's default), non-reentrant gradient checkpointing, SDPA
attention (GPT-OSS: flex), batch 4 × 4096 tokens. It also reports the longest sequence that
trains at batch 1 (searched in steps of 4096 tokens; off by default for the three families, whose
steps are slow). ``--memory-profile`` adds, per setup, the largest tensors alive at the peak and
where they were allocated.

``--lora`` trains PEFT LoRA adapters instead (r 16, alpha 32, no dropout, on q, k, v, o, gate, up
and down; fp32 adapters on the bf16 model), AdamW on the adapters only, and adds tigon's full
fine-tuning of the same model and batch for scale; on Qwen3-MoE (``--model qwen3_moe``) the
adapters are on the attention's projections and the experts' stacked weights (PEFT's
``target_parameters``). ``--qlora`` does the same over a 4-bit base (Llama): the decoder's linear
layers as bitsandbytes NF4 layers computing in bf16.

``--budget hf`` trains each setup at its best gradient checkpointing within one memory budget:
Hugging Face's own peak with every layer recomputed (``--budget 30`` gives GiB instead). Each
setup, Hugging Face included, runs the same search, :func:`tigon.transformers.fit_checkpointing`,
which probes training steps and keeps the activations of as many of the last layers as fit; each
result records the plan, every probe's peak and the timed steps' own peak against the budget.

``--cuda-graph`` captures each setup's whole training step (forward, backward, AdamW with
``capturable=True``, gradients zeroed in place) as one CUDA graph after three warm-up steps on a
side stream, and replays it on every new batch, copied into the captured input: no host time is
left in the step, which is what small batches are bound by. A setup whose step cannot be captured
(a host sync inside it) fails and says why. The peak memory is the capture's (replays allocate
nothing).

``--gpus 2 1`` trains each setup under FSDP2 on 2 GPUs (one torchrun launch: each decoder layer an
FSDP2 unit, the root unit holding the embeddings, the final norm and the head, whose weight the
fused losses read inside the root's forward, unsharded), then on one GPU without FSDP, so that one
run gives each setup's speed-up and memory saving on one GPU and on several. Each GPU trains on
its own batch; reported per GPU: tokens/s (the mean over GPUs) and peak memory (the largest).

``--fp8 RECIPE`` adds FP8: the setups ``hf``, ``hf_fp8`` (Hugging Face's model converted by
torchao's ``convert_to_float8_training`` with the recipe: ``tensorwise``, ``rowwise`` or
``rowwise_with_gw_hp``), ``tigon`` and ``tigon_fp8`` (tigon's model converted the same way, its
fused loss in FP8 by the head's recipe: docs/integrations/fp8.md), each converted after it is
built, every linear whose dimensions divide by 16 (lm_head included). torchao's casts are fused
only by the compiler (in eager mode each is a few passes over the tensor: Hugging Face + torchao
trains at 0.57× Hugging Face on the H100), so FP8 is compared with ``--compile``: every setup's
decoder layers compiled, as torchtitan trains FP8.

``--trl sft grpo`` trains under TRL instead (:mod:`tigon.bench.e2e_trl`): ``SFTTrainer`` with TRL's
fused LM head, and GRPO's policy log-probs, forward + backward; its setups patch the built model
as a TRL user would (``hf``: TRL alone; ``tigon_head``: ``patch_trl()``; ``tigon``: ``apply_tigon``
and ``patch_trl()``; ``liger``).

``--smoke`` is a run of the same code paths at tiny sizes (the models' tiny shapes: hidden 64, 2
layers; 2 × 64 tokens, one warm-up and two timed steps), in fp32, on the CPU through Triton's
interpreter where there is no GPU; one process per setup runs every model and loop (the imports
dominate), FSDP2 runs on gloo. No memory is measured on the CPU and the timings mean nothing; the
losses of tigon and Hugging Face agree to ~1e-6.

Writes ``e2e_<model>[_trl_<loop>][_lora|_qlora][_aux_loss][_budget_<b>][_b<B>x<T>][_graph][_compiled][_fp8_<recipe>][_fsdp2].json``
and ``.png`` per model and loop into ``--out`` (default: ``tigon-out/bench-<gpu>`` of the working
directory, ``tigon-out/bench-smoke`` for smoke runs), rewritten after every process, so a run cut
short keeps what it measured. Results committed to the repository go to
``--out benchmarks/results/<gpu>``.

    tigon bench e2e [--model llama llama_1b qwen3_moe qwen2_5_vl deepseek_v3 gpt_oss] [--setups hf liger tigon]
        [--trl sft grpo] [--gpus N ...] [--lora | --qlora] [--budget hf | GiB] [--cuda-graph] [--compile]
        [--fp8 RECIPE] [--layers L] [--batch 4] [--seq-len 4096] [--warmup W] [--steps S] [--smoke] [--out DIR] ...
    (python -m tigon.bench.e2e takes the same arguments)

On the GPU machine, peers travel as wheels (``carry: [".whl"]``; liger-kernel 0.8.5, and for
``--trl`` trl 1.16.0, datasets 5.2.0 with dill and multiprocess): ``bash benchmarks/gpu_session.sh
bench e2e ...`` installs them and runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tigon.bench import e2e_trl
from tigon.bench.e2e_models import (
    MODELS, attention_for, batch_maker, build_model, decoder_layers, experts_in, quantize_4bit, with_lora,
)
from tigon.bench.machine import (
    BENCH_EXTRA, default_out, environment, peak_gib, require_modules, reset_peak, synchronize,
)
from tigon.bench.processes import failure_record, launch, print_result
from tigon.ops.fp8 import RECIPES as FP8_RECIPES

SETUPS = ("hf", "liger", "tigon", "tigon_head", "hf_fp8", "tigon_fp8")
LABELS = {"hf": "Hugging Face", "liger": "Hugging Face + Liger-Kernel", "tigon": "Hugging Face + tigon",
          "hf_fp8": "Hugging Face + torchao float8", "tigon_fp8": "Hugging Face + tigon + torchao float8"}
# With --fp8: the setups converted by torchao after they are built (the name without the suffix).
FP8_SUFFIX = "_fp8"
FP8_SETUPS = ("hf", "hf_fp8", "tigon", "tigon_fp8")
# The setups a loop runs unless --setups names others.
DEFAULT_SETUPS = {
    "train": ("hf", "liger", "tigon"), "sft": ("hf", "liger", "tigon"), "grpo": ("hf", "tigon_head", "tigon"),
}
# With --lora, tigon's full fine-tuning runs last, for scale.
FULL_TIGON = "tigon-full"
# Sizes unless an option says otherwise: the GPU run's (its steps per loop), and the smoke run's.
SIZES = dict(batch=4, seq_len=4096, prompt_len=512, image_side=448)
STEPS = {"train": dict(warmup=2, steps=6), "sft": dict(warmup=3, steps=10), "grpo": dict(warmup=2, steps=5)}
SMOKE = dict(layers=2, batch=2, seq_len=64, warmup=1, steps=2, prompt_len=16, image_side=168, max_search=0)
TIMEOUT_S = 900
COLORS = {"hf": "tab:gray", "liger": "tab:blue", "tigon": "tab:orange", "tigon_head": "lightsalmon",
          "hf_fp8": "tab:purple", "tigon_fp8": "tab:red",
          FULL_TIGON: "tab:olive"}


@dataclass(frozen=True)
class Job:
    """One setup of one model trained by one loop on ``gpus`` GPUs (FSDP2 above 1)."""

    loop: str
    model: str
    setup: str
    gpus: int = 1

    def __str__(self) -> str:
        return f"{self.loop}:{self.model}:{self.setup}:{self.gpus}"

    @classmethod
    def parse(cls, text: str) -> Job:
        loop, model, setup, gpus = text.split(":")
        return cls(loop, model, setup, int(gpus))


def label(job: Job, lora: str | None = None) -> str:
    """The setup's name in tables and plots; ``lora`` is "LoRA", "QLoRA" or ``None``."""
    if job.loop != "train":
        name = e2e_trl.LABELS[job.loop][job.setup]
    elif job.setup == FULL_TIGON:
        name = "Hugging Face + tigon, full fine-tuning"
    else:
        name = LABELS[job.setup] + (f" + PEFT {lora}" if lora else "")
    return name + (f", {job.gpus} GPUs (FSDP2)" if job.gpus > 1 else "")


# The training step of the default loop.


def new_optimizer(model, kind: str, capturable: bool = False) -> torch.optim.Optimizer:
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=1e-5, fused=kind == "fused", foreach=kind == "foreach", capturable=capturable)


def train_step(model, optimizer, inputs: dict, phase_peaks: dict | None = None) -> float:
    """One step on ``inputs``; with ``phase_peaks`` (on a GPU), the peak memory (GiB) of each phase
    is recorded into it."""
    device = inputs["input_ids"].device.type

    def end_phase(name):
        if phase_peaks is not None and device == "cuda":
            torch.cuda.synchronize()
            phase_peaks[name] = max(phase_peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()

    if phase_peaks is not None:
        reset_peak(device)
    loss = model(**inputs).loss
    end_phase("forward")
    loss.backward()
    end_phase("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end_phase("optimizer")
    return loss.item()


def captured_train_step(model, optimizer, new_batch: Callable[[], dict]) -> tuple[Callable[[], float], float]:
    """The training step captured as one CUDA graph: → (a call that copies a new batch into the
    captured inputs, replays the graph and returns the loss; the peak memory (GiB) of the warm-up
    and the capture). ``optimizer`` must be capturable."""
    inputs = new_batch()

    def step():
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the captured gradients stay where the graph wrote them
        return loss.detach()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Warm-up on a side stream, as capture requires: Triton compiles, cuBLAS picks its kernels,
    # the optimizer's state and the gradients are allocated.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    torch.cuda.synchronize()
    capture_peak = torch.cuda.max_memory_allocated() / 2**30

    def replay() -> float:
        for name, tensor in new_batch().items():
            inputs[name].copy_(tensor)
        graph.replay()
        return loss.item()

    return replay, capture_peak


def peak_tensors(model, optimizer, inputs: dict, top: int = 24) -> list[dict]:
    """The ``top`` largest allocations alive at the peak of one recorded step, with the frames of
    tigon, transformers or the optimizer that allocated them."""
    # Python frames only, at allocation: the C++ stacks recorded by default fail under compiled
    # layers (torch 2.11: "SystemError: ... returned NULL without setting an exception").
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=200_000)
    train_step(model, optimizer, inputs)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, peak_live, in_use, peak = {}, {}, 0, 0
    for event in (e for trace in snapshot["device_traces"] for e in trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            in_use += event["size"]
            if in_use > peak:
                peak, peak_live = in_use, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            in_use -= live.pop(event["addr"])["size"]
    keep = ("tigon", "transformers", "optim", "autograd", "checkpoint")
    rows = []
    for event in sorted(peak_live.values(), key=lambda e: -e["size"])[:top]:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in event["frames"]]
        ours = [frame for frame, f in zip(frames, event["frames"]) if any(k in f["filename"] for k in keep)]
        rows.append({"mib": event["size"] / 2**20, "frames": (ours or frames)[:4]})
    return rows


def time_steps(step: Callable[[], float], tokens_per_step: int, warmup: int, steps: int, device: str,
               phase_step: Callable[[dict], float] | None = None) -> dict:
    """``warmup`` calls of ``step`` (→ the loss), then ``steps`` timed ones: tokens/s of this
    process, the peak memory of its training steps (``None`` on the CPU) and every step's loss;
    then, with ``phase_step`` on a GPU, one more step that records the peak of each phase."""
    losses = [step() for _ in range(warmup)]
    synchronize(device)
    reset_peak(device)
    start = time.perf_counter()
    losses += [step() for _ in range(steps)]
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = peak_gib(device)
    phase_peaks = {}
    if phase_step is not None and device == "cuda":
        losses.append(phase_step(phase_peaks))
    return {
        "tokens_per_second": tokens_per_step * steps / seconds, "peak_memory_gib": peak,
        "peak_memory_by_phase_gib": phase_peaks, "losses": losses,
    }


def fit_budget(model, optimizer, inputs: dict, budget: str) -> dict:
    """Fits ``model``'s checkpointing to ``budget`` (GiB, or "self": its own peak with every layer
    recomputed) on ``inputs``, a probe batch of the training shape; returns the plan as a result's record."""
    from tigon.transformers import fit_checkpointing

    plan = fit_checkpointing(model, inputs, None if budget == "self" else float(budget), optimizer=optimizer)
    return {
        "budget_gib": plan.budget_gib, "layers_kept": plan.kept, "layers_recomputed": plan.recomputed,
        "probe_peak_gib": plan.peak_gib, "probes_gib": plan.probes,
    }


def longest_sequence(step: Callable[[int, int], float], optimizer, max_len: int) -> int:
    """The longest sequence (in steps of 4096 from 8192, up to ``max_len``) that ``step(batch,
    seq_len)`` trains at batch 1 before running out of memory."""
    longest = 0
    for trial in range(8192, max_len + 1, 4096):
        try:
            step(1, trial)
            longest = trial
        except torch.OutOfMemoryError:
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return longest


def shard(model) -> None:
    """FSDP2 over the process group: each decoder layer a unit, the root unit the rest."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def run_train(args, job: Job, device: str) -> dict:
    """One setup of the default loop in this process (one rank of it under FSDP2)."""
    import torch.distributed as dist

    sharded = dist.is_initialized()
    rank = dist.get_rank() if sharded else 0
    lora = (args.lora or args.qlora) and job.setup != FULL_TIGON
    shape = {"output_router_logits": True} if args.router_aux_loss else {}
    built_as = "tigon" if job.setup == FULL_TIGON else job.setup.removesuffix(FP8_SUFFIX)
    model = build_model(built_as, args.layers, device, model=job.model,
                        dtype=torch.float32 if args.smoke else torch.bfloat16, tiny=args.smoke,
                        attention=args.attn, **shape)
    result = {"experts": experts_in(model), "parameters": sum(p.numel() for p in model.parameters())}
    if job.setup.endswith(FP8_SUFFIX):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        # Every linear whose dimensions divide by 16, lm_head included (torchao's default filter).
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(args.fp8))
        result["fp8"] = args.fp8
    if lora and args.qlora:
        model = quantize_4bit(model)
    if lora:
        model = with_lora(model)
    if args.compile:
        for layer in decoder_layers(model):
            layer.compile()
    if sharded:
        shard(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    optimizer = new_optimizer(model, args.optimizer, capturable=args.cuda_graph)
    batch_of = batch_maker(job.model, model.config, args.image_side)
    if args.budget_gib:
        # On a generator of its own: the timed steps' data stay as without probes.
        probe = batch_of(args.batch, args.seq_len, torch.Generator(device=device).manual_seed(1))
        result["checkpointing"] = fit_budget(model, optimizer, probe, args.budget_gib)
    generator = torch.Generator(device=device).manual_seed(rank)  # under FSDP2, each GPU its own batch
    tokens_per_step = args.batch * args.seq_len
    if args.cuda_graph:
        def new_batch():
            return batch_of(args.batch, args.seq_len, generator)

        step, capture_peak = captured_train_step(model, optimizer, new_batch)
        result.update(time_steps(step, tokens_per_step, args.warmup, args.steps, device))
        result["peak_memory_gib"] = max(result["peak_memory_gib"], capture_peak)
    else:
        def step(batch=args.batch, seq_len=args.seq_len, phase_peaks=None):
            return train_step(model, optimizer, batch_of(batch, seq_len, generator), phase_peaks)

        result.update(time_steps(step, tokens_per_step, args.warmup, args.steps, device,
                                 lambda phase_peaks: step(phase_peaks=phase_peaks)))
    if "checkpointing" in result:
        plan = result["checkpointing"]
        plan["within_budget"] = result["peak_memory_gib"] <= plan["budget_gib"]
    if args.memory_profile:
        result["peak_tensors"] = peak_tensors(model, optimizer, batch_of(args.batch, args.seq_len, generator))
    if args.max_search:
        result["longest_seq_len_batch1"] = longest_sequence(step, optimizer, args.max_search)
    if sharded:
        per_gpu = [None] * dist.get_world_size()
        dist.all_gather_object(per_gpu, {k: result[k] for k in ("tokens_per_second", "peak_memory_gib", "losses")})
        peaks = [measured["peak_memory_gib"] for measured in per_gpu]
        result.update(
            tokens_per_second=sum(measured["tokens_per_second"] for measured in per_gpu) / len(per_gpu),
            peak_memory_gib=None if None in peaks else max(peaks), per_gpu=per_gpu,
        )
    result["lora"] = "QLoRA" if lora and args.qlora else "LoRA" if lora else None
    result["optimizer"] = f"AdamW ({args.optimizer})"
    result["cuda_graph"] = args.cuda_graph
    result["compiled"] = args.compile
    if result["experts"] and MODELS[job.model].router_aux_loss:
        result["router_aux_loss"] = args.router_aux_loss
    return result


# Jobs, each in a process of its own (one per setup in a smoke run).


def job_args(args, job: Job) -> argparse.Namespace:
    """``args`` with the job's sizes: those given, else the smoke run's or the loop's defaults."""
    spec = MODELS[job.model]
    defaults = {**SIZES, **STEPS[job.loop], "layers": spec.layers, "max_search": spec.max_search}
    if args.smoke:
        defaults.update(SMOKE)
    if args.budget is not None or args.cuda_graph or args.compile or job.gpus > 1 or job.loop != "train":
        # Probed with eager steps; the search trains eagerly (or recompiles) on other shapes; one GPU's memory.
        defaults["max_search"] = 0
    resolved = argparse.Namespace(**vars(args))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(resolved, name, value)
    return resolved


def run_job(args, job: Job, device: str) -> dict:
    """``job`` in this process: its result, or its error (a failing setup is a result, not the end)."""
    resolved = job_args(args, job)
    lora = "QLoRA" if args.qlora else "LoRA" if args.lora else None
    result = {"loop": job.loop, "model": job.model, "setup": job.setup, "gpus": job.gpus,
              "label": label(job, lora)}
    result.update({name: getattr(resolved, name) for name in ("layers", "batch", "seq_len", "warmup", "steps")})
    if job.loop == "grpo":
        result.update(prompt_len=resolved.prompt_len, temperature=resolved.temperature)
    if MODELS[job.model].vision:
        result["image_side"] = resolved.image_side
    result["attention"] = attention_for(job.model, device, args.attn)
    try:
        if job.loop == "train":
            result.update(run_train(resolved, job, device))
        else:
            run = e2e_trl.run_sft if job.loop == "sft" else e2e_trl.run_grpo
            result.update(run(resolved, job.model, job.setup, device))
    except Exception as error:  # noqa: BLE001  (recorded: out of memory, a patch raising, a peer missing)
        traceback.print_exc()
        result.update(failure_record(error))
    return result


def run_child(args) -> int:
    """The ``--child`` process: its jobs one after the other; rank 0 prints their results."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    jobs = [Job.parse(text) for text in args.child]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        if device == "cuda":
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    results = []
    for job in jobs:
        results.append(run_job(args, job, device))
        if device == "cuda":
            torch.cuda.empty_cache()
    if distributed:
        rank = dist.get_rank()
        # Once every rank has let go of its model (FSDP2 holds the group) and reached here: a gloo
        # group torn down while a peer still uses it aborts the process ("terminate called without
        # an active exception"), as the examples' processes also guard against.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        if rank:
            return 0
    print_result(results)
    return 0


def child_command(argv: list[str], jobs: list[Job], gpus: int, budget: str | None) -> list[str]:
    """This command again (its options as given), as the process running ``jobs``: torchrun's
    ``gpus`` processes above 1."""
    launcher = [sys.executable]
    if gpus > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return [*launcher, "-m", "tigon.bench.e2e", *argv, "--child", *map(str, jobs),
            *(["--budget-gib", budget] if budget else [])]


def plan_jobs(args) -> list[list[Job]]:
    """The jobs, grouped by process: one each on a GPU; in a smoke run one process per (GPU count,
    setup) runs every model and loop of that setup. Hugging Face's first, then the setups in the
    order given, each model and loop in turn."""
    loops = args.trl or ["train"]
    jobs = []
    for gpus in args.gpus:
        for model in args.model:
            for loop in loops:
                setups = list(args.setups or (FP8_SETUPS if args.fp8 else DEFAULT_SETUPS[loop]))
                setups.sort(key=lambda setup: setup != "hf")
                if loop == "train" and (args.lora or args.qlora):
                    setups.append(FULL_TIGON)
                jobs += [Job(loop, model, setup, gpus) for setup in setups]
    if not args.smoke:
        return [[job] for job in jobs]
    groups: dict[tuple[int, str], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.gpus, job.setup), []).append(job)
    return list(groups.values())


# Results.


def add_comparisons(results: list[dict]) -> None:
    """Against the ``hf`` row of the same GPU count: speed-up, memory (overall and per phase), the
    first step's loss and the largest difference of a step's loss."""
    for r in results:
        base = next((b for b in results if b["setup"] == "hf" and b["gpus"] == r["gpus"] and "error" not in b), None)
        if base is None or "error" in r:
            continue
        r["speedup_vs_hf"] = r["tokens_per_second"] / base["tokens_per_second"]
        if r["peak_memory_gib"] is not None and base["peak_memory_gib"]:
            r["memory_vs_hf"] = r["peak_memory_gib"] / base["peak_memory_gib"]
        phases = base.get("peak_memory_by_phase_gib") or {}
        if r.get("peak_memory_by_phase_gib") and phases:
            r["memory_vs_hf_by_phase"] = {
                phase: peak / phases[phase] for phase, peak in r["peak_memory_by_phase_gib"].items() if phase in phases
            }
        if r.get("losses") and base.get("losses"):
            r["step0_loss_rel_diff_vs_hf"] = abs(r["losses"][0] - base["losses"][0]) / abs(base["losses"][0])
            r["max_loss_diff_vs_hf"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(record: dict) -> None:
    results = record["results"]
    smoke = " (smoke run: the timings mean nothing)" if record["smoke"] else ""
    print(f"\n{record['title']}, {record['loop']}{smoke}")
    columns = [("tokens/s", "tokens_per_second", ",.0f"), ("speed-up", "speedup_vs_hf", ".2f"),
               ("peak GiB", "peak_memory_gib", ".2f"), ("memory", "memory_vs_hf", ".0%")]
    if record["loop"] == "grpo":
        columns += [("ms", "ms_per_step", ".1f"), ("mean logp", "mean_log_prob", ".5f"),
                    ("grad norm", "grad_norm", ".4f")]
    else:
        columns += [("step-0 loss", "losses", ".6f")]
    if any(r.get("longest_seq_len_batch1") for r in results):
        columns.append(("longest T @ B=1", "longest_seq_len_batch1", ","))
    width = max(len(r["label"]) for r in results) + 2
    print(f"{'setup':<{width}}" + "".join(f"{heading:>16}" for heading, _, _ in columns))
    for r in results:
        if "error" in r:
            print(f"{r['label']:<{width}}failed: {r['error']}")
            continue
        cells = [_cell((r.get(key) or [None])[0] if key == "losses" else r.get(key), spec) for _, key, spec in columns]
        print(f"{r['label']:<{width}}" + "".join(f"{cell:>16}" for cell in cells))
    for r in results:
        if "error" in r:
            continue
        notes = []
        if r.get("peak_memory_by_phase_gib"):
            notes.append(f"peak by phase (GiB): {({k: round(v, 2) for k, v in r['peak_memory_by_phase_gib'].items()})}")
        if r.get("experts"):
            notes.append(f"experts: {r['experts']}")
        if r.get("head"):
            notes.append(f"head: {r['head']}" + (f" ({r['head_mode']})" if r.get("head_mode") else ""))
        if "checkpointing" in r:
            plan = r["checkpointing"]
            notes.append(f"recomputes {plan['layers_recomputed']} of {plan['layers_recomputed'] + plan['layers_kept']} "
                         f"layers within {plan['budget_gib']:.2f} GiB; probe peak {plan['probe_peak_gib']:.2f}, "
                         f"timed peak {r['peak_memory_gib']:.2f} GiB")
        if notes:
            print(f"{r['label']}: " + "; ".join(notes))
        for row in r.get("peak_tensors", []):
            print(f"  {row['mib']:9.1f} MiB  " + " <- ".join(row["frames"]))
    diffs = {r["label"]: r["step0_loss_rel_diff_vs_hf"] for r in results if r["setup"] != "hf"
             and "step0_loss_rel_diff_vs_hf" in r}
    if diffs:
        print(f"step-0 loss vs the hf setup's, relative: max {max(diffs.values()):.2e}")


def plot(record: dict, path: Path) -> None:
    """Tokens/s, peak memory, the longest sequence (when searched) and the loss per step of every setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    labels = [r["label"].replace("Hugging Face", "HF").replace(" + ", "\n+ ").replace(", ", ",\n") for r in results]
    for i, r in enumerate(results):
        if "checkpointing" in r:
            labels[i] += f"\nrecomputes {r['checkpointing']['layers_recomputed']}/{r['layers']} layers"
    first = next(r for r in results if "error" not in r)
    graphed = ", one CUDA graph per step" if first.get("cuda_graph") else ""
    graphed += ", decoder layers compiled" if first.get("compiled") else ""
    per_gpu = " per GPU" if any(r["gpus"] > 1 for r in results) else ""
    panels = [("tokens_per_second", f"tokens/s{per_gpu} (batch {first['batch']} × {first['seq_len']}{graphed})")]
    if any(r.get("peak_memory_gib") for r in results):  # none on the CPU
        panels.append(("peak_memory_gib", f"peak memory{per_gpu} (GiB)"))
    if any(r.get("longest_seq_len_batch1") for r in results):
        panels.append(("longest_seq_len_batch1", "longest sequence at batch 1"))
    with_losses = [r for r in results if len(r.get("losses", [])) > 1]
    fig, axes = plt.subplots(1, len(panels) + bool(with_losses), figsize=(5.5 * (len(panels) + bool(with_losses)), 4.5),
                             squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        values = [r.get(key) or 0 for r in results]
        ax.bar(range(len(results)), values, color=[COLORS.get(r["setup"], "tab:green") for r in results])
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        for i, (r, value) in enumerate(zip(results, values)):
            number = f"{value:,.0f}" if value > 100 else f"{value:.1f}"
            text = "failed" if "error" in r else number if value else "-"
            ax.annotate(text, (i, value), ha="center", va="bottom", fontsize=8)
    if with_losses:
        # Hugging Face's losses as a thick line, the others drawn over it: where they agree, they overlap.
        ax = axes[0, -1]
        for r in with_losses:
            hf = r["setup"] == "hf"
            ax.plot(r["losses"], marker="o", label=r["label"].replace("Hugging Face", "HF"),
                    color=COLORS.get(r["setup"], "tab:green"), linewidth=4 if hf else 1.5, alpha=0.5 if hf else 1.0)
        ax.set(title="loss per step (same data and initial weights)", xlabel="step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    config = record["config"]
    what = {"train": "training step", "sft": "TRL SFTTrainer", "grpo": "GRPO log-probs, forward + backward"}
    lora = first.get("lora")
    if lora:
        targets = "attention and experts" if first.get("experts") else "all linear layers"
        what["train"] = f"PEFT {'QLoRA (NF4 base)' if lora == 'QLoRA' else 'LoRA'} r 16 on {targets}"
    checkpointing = "gradient checkpointing"
    if "checkpointing" in first:
        checkpointing = f"checkpointing fitted to {first['checkpointing']['budget_gib']:.1f} GiB"
    model, device = f"{first['layers']}-layer {record['title']} shapes", record["environment"]["device"]
    if record["smoke"]:
        model, device = f"tiny stand-in for {record['title']}", f"{device} (smoke run: timings mean nothing)"
    fig.suptitle(f"{model}, {config['dtype']}, {what[record['loop']]}, {checkpointing} — {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def file_stem(args, model: str, loop: str) -> str:
    name = f"e2e_{model}" + (f"_trl_{loop}" if loop != "train" else "")
    name += "_qlora" if args.qlora else "_lora" if args.lora else ""
    if args.router_aux_loss:
        name += "_aux_loss"
    if args.budget is not None:
        name += f"_budget_{args.budget}"
    batch, seq_len = args.batch or SIZES["batch"], args.seq_len or SIZES["seq_len"]
    if not args.smoke and (batch, seq_len) != (SIZES["batch"], SIZES["seq_len"]):
        name += f"_b{batch}x{seq_len}"
    if args.cuda_graph:
        name += "_graph"
    if args.compile:
        name += "_compiled"
    if args.fp8:
        name += f"_fp8_{args.fp8}"
    if any(gpus > 1 for gpus in args.gpus):
        name += "_fsdp2"
    return name


def new_record(args, model: str, loop: str, device: str) -> dict:
    return {
        "model": model, "title": MODELS[model].title, "loop": loop, "smoke": args.smoke,
        "environment": environment(device),
        "config": {"dtype": "fp32" if args.smoke else "bf16", "gpus": args.gpus,
                   "optimizer": f"AdamW ({args.optimizer})" if loop == "train" else "adamw_torch_fused",
                   "gradient_checkpointing": "non-reentrant"},
        "results": [],
    }


# The command.


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="tigon bench e2e", description=__doc__.splitlines()[0] + " See python -m pydoc tigon.bench.e2e.",
    )
    what = parser.add_argument_group("what is trained")
    what.add_argument("--model", nargs="+", choices=list(MODELS), default=["llama"], metavar="MODEL",
                      help=f"whose layer shapes, one result file each: {', '.join(MODELS)} (default: llama)")
    what.add_argument("--setups", nargs="+", choices=SETUPS, metavar="SETUP",
                      help="hf, liger, tigon; tigon_head (tigon's kernel behind TRL's head) with --trl. "
                      "Default: hf liger tigon; hf tigon_head tigon for --trl grpo")
    what.add_argument("--trl", nargs="+", choices=e2e_trl.LOOPS, metavar="LOOP",
                      help="train under TRL instead: sft (SFTTrainer), grpo (GRPO's policy log-probs, forward + "
                      "backward); Llama models only")
    what.add_argument("--gpus", nargs="+", type=int, default=[1], metavar="N",
                      help="train each setup on each of these GPU counts, under FSDP2 above 1 (torchrun; gloo on "
                      "the CPU with --smoke) (default: 1)")
    what.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters; adds tigon's full fine-tuning")
    what.add_argument("--qlora", action="store_true", help="as --lora over a bitsandbytes 4-bit NF4 base")
    what.add_argument("--router-aux-loss", action="store_true",
                      help="with --model qwen3_moe: add the router's auxiliary loss (off in the released config)")
    what.add_argument("--budget", help="'hf' (Hugging Face's peak) or GiB: each setup at its best per-layer "
                      "checkpointing within this peak")
    what.add_argument("--fp8", choices=FP8_RECIPES, metavar="RECIPE",
                      help=f"torchao's float8 training recipe ({', '.join(FP8_RECIPES)}) for the hf_fp8 and "
                      "tigon_fp8 setups, converted after they are built; the default setups become hf hf_fp8 tigon "
                      "tigon_fp8")
    what.add_argument("--cuda-graph", action="store_true",
                      help="capture each setup's whole training step as one CUDA graph and replay it")
    what.add_argument("--compile", action="store_true",
                      help="torch.compile each decoder layer of every setup (torchao's float8 casts are fused only "
                      "so: compare FP8 with it)")
    what.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                      help="PyTorch's AdamW implementation (default: fused; the TRL loops use the trainer's fused one)")
    what.add_argument("--attn", help="attn_implementation of every model (default: sdpa; flex_attention for "
                      "gpt_oss, eager on the CPU)")
    sizes = parser.add_argument_group("sizes (defaults: the smoke run's with --smoke)")
    sizes.add_argument("--layers", type=int, help="decoder layers (default: 4; 16, the whole model, for llama_1b; 2 "
                       "with --smoke)")
    sizes.add_argument("--batch", type=int, help="sequences per step, per GPU (default: 4; 2 with --smoke)")
    sizes.add_argument("--seq-len", type=int, help="tokens per sequence (default: 4096; 64 with --smoke)")
    sizes.add_argument("--warmup", type=int, help="steps before the timed ones (default: 2; 3 for --trl sft; 1 "
                       "with --smoke)")
    sizes.add_argument("--steps", type=int, help="timed steps (default: 6; 10 for --trl sft, 5 for --trl grpo; 2 "
                       "with --smoke)")
    sizes.add_argument("--max-search", type=int,
                       help="longest sequence tried at batch 1, 0 for none (default: 65536 for llama, llama_1b and "
                       "qwen3_moe, 0 for the others and with --smoke, --budget, --cuda-graph, --gpus above 1, --trl)")
    sizes.add_argument("--image-side", type=int, help="pixels of each sample's square image, qwen2_5_vl (default: "
                       "448; 168 with --smoke)")
    sizes.add_argument("--prompt-len", type=int, help="prompt tokens of each --trl grpo sequence (default: 512; 16 "
                       "with --smoke)")
    sizes.add_argument("--temperature", type=float, default=1.0,
                       help="--trl grpo's sampling temperature (default: 1.0)")
    run = parser.add_argument_group("the run")
    run.add_argument("--smoke", action="store_true",
                     help="tiny fp32 models, on the CPU without a GPU: checks the code paths, times nothing")
    run.add_argument("--memory-profile", action="store_true",
                     help="add the largest tensors alive at each setup's peak and where they were allocated")
    run.add_argument("--timeout", type=float, default=TIMEOUT_S,
                     help=f"seconds each setup's process may take (default: {TIMEOUT_S})")
    run.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu> of the working "
                     "directory; tigon-out/bench-smoke with --smoke)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--budget-gib", help=argparse.SUPPRESS)  # a child's: GiB, or "self"
    args = parser.parse_args(argv)
    args.model = list(dict.fromkeys(args.model))
    return parser, args


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The combinations that cannot run, refused by name."""
    lora = args.lora or args.qlora
    gpu_only = [name for name, given in (("--budget", args.budget is not None), ("--cuda-graph", args.cuda_graph),
                                         ("--compile", args.compile),
                                         ("--qlora", args.qlora), ("--memory-profile", args.memory_profile)) if given]
    if args.budget is not None:
        if args.budget != "hf" and not _positive_number(args.budget):
            parser.error(f"--budget takes 'hf' or a number of GiB, got {args.budget!r}")
        if args.budget == "hf" and args.setups and "hf" not in args.setups:
            parser.error("--budget hf needs the hf setup (--setups hf ...)")
        if lora:
            parser.error("--budget trains full fine-tuning only")
    for option, given in (("--cuda-graph", args.cuda_graph), ("--budget", args.budget is not None),
                          ("--trl", bool(args.trl))):
        if args.compile and given:
            parser.error(f"--compile and {option} do not combine")
    if args.cuda_graph and lora:
        parser.error("--cuda-graph trains full fine-tuning only")
    if args.cuda_graph and args.budget is not None:
        # The plan is probed with eager steps; a captured step also holds its graph's private memory
        # pool (1.1 GiB over the budget for the 1B at batch 1 x 1024), so the budget would not hold.
        parser.error("--cuda-graph and --budget do not combine: the budget is probed with eager steps")
    llama = {"llama", "llama_1b"}
    if args.qlora and not set(args.model) <= llama:
        parser.error("--qlora trains the Llama models only (--model llama llama_1b)")
    if args.lora and not set(args.model) <= llama | {"qwen3_moe"}:
        parser.error("--lora trains the Llama models and Qwen3-MoE only (--model llama llama_1b qwen3_moe)")
    if args.router_aux_loss and not any(MODELS[model].router_aux_loss for model in args.model):
        parser.error("--router-aux-loss needs a mixture of experts (--model qwen3_moe)")
    if args.trl:
        if not set(args.model) <= llama:
            parser.error("--trl trains the Llama models only (--model llama llama_1b)")
        for option, given in (("--lora", args.lora), ("--qlora", args.qlora), ("--budget", args.budget is not None),
                              ("--cuda-graph", args.cuda_graph), ("--memory-profile", args.memory_profile),
                              ("--router-aux-loss", args.router_aux_loss), ("--gpus above 1", max(args.gpus) > 1)):
            if given:
                parser.error(f"--trl and {option} do not combine: TRL's trainer runs its own loop")
    elif args.setups and "tigon_head" in args.setups:
        parser.error("the tigon_head setup patches TRL's head: it needs --trl")
    fp8_setups = [setup for setup in args.setups or () if setup.endswith(FP8_SUFFIX)]
    if fp8_setups and not args.fp8:
        parser.error(f"the {', '.join(fp8_setups)} setup(s) train in FP8: they need --fp8 RECIPE")
    if args.fp8:
        for option, given in (("--trl", bool(args.trl)), ("--lora", args.lora), ("--qlora", args.qlora),
                              ("--budget", args.budget is not None), ("--cuda-graph", args.cuda_graph),
                              ("--gpus above 1", max(args.gpus) > 1)):
            if given:
                parser.error(f"--fp8 and {option} do not combine (yet)")
    if min(args.gpus) < 1:
        parser.error(f"--gpus takes counts of at least 1, got {args.gpus}")
    if max(args.gpus) > 1:
        for option, given in (("--lora", args.lora), ("--qlora", args.qlora), ("--budget", args.budget is not None),
                              ("--cuda-graph", args.cuda_graph), ("--memory-profile", args.memory_profile)):
            if given:
                parser.error(f"--gpus above 1 and {option} do not combine")
    for name in ("layers", "batch", "seq_len", "steps", "image_side", "prompt_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} takes at least 1, got {getattr(args, name)}")
    if args.warmup is not None and args.warmup < (1 if args.trl else 0):
        parser.error(f"--warmup takes at least {1 if args.trl else 0} here, got {args.warmup}")
    if args.smoke and gpu_only:
        parser.error(f"{', '.join(gpu_only)} measure(s) a GPU: not with --smoke")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse_args(argv)
    check_args(parser, args)
    require_modules("tigon bench e2e", BENCH_EXTRA)
    if args.child:
        return run_child(args)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("tigon bench e2e trains on a GPU; no CUDA device is available here. "
              "`tigon bench e2e --smoke` runs tiny models on the CPU (it times nothing).")
        return 1
    if on_gpu and max(args.gpus) > torch.cuda.device_count():
        parser.error(f"--gpus {max(args.gpus)}: this machine has {torch.cuda.device_count()} GPU(s)")
    device = "cuda" if on_gpu else "cpu"
    gpu = torch.cuda.get_device_name() if on_gpu else None
    out = args.out or default_out(args.smoke, gpu)
    out.mkdir(parents=True, exist_ok=True)
    loops = args.trl or ["train"]
    records = {(model, loop): new_record(args, model, loop, device) for model in args.model for loop in loops}
    for group in plan_jobs(args):
        what = f"{group[0].setup} on {group[0].gpus} GPU(s)" if on_gpu else f"{group[0].setup}"
        what += f": {', '.join(f'{job.loop} {job.model}' for job in group)}"
        print(f"{what} ...", flush=True)
        budget = args.budget
        if args.budget == "hf":
            # Hugging Face's own peak is the budget: it runs first and fits itself ("self").
            base = next((r for r in records[group[0].model, group[0].loop]["results"] if r["setup"] == "hf"), None)
            if group[0].setup == "hf":
                budget = "self"
            elif base is None or "checkpointing" not in base:
                print(f"{group[0].model}: Hugging Face's run failed: no budget to fit {group[0].setup} to")
                continue
            else:
                budget = str(base["checkpointing"]["budget_gib"])
        results = launch(child_command(argv, group, group[0].gpus, budget), what, args.timeout) or [
            {"loop": job.loop, "model": job.model, "setup": job.setup, "gpus": job.gpus, "label": label(job),
             "error": "its process failed (see the log)"} for job in group
        ]
        for result in results:
            record = records[result["model"], result["loop"]]
            record["results"].append(result)
            add_comparisons(record["results"])
            summary = {k: v for k, v in result.items() if k not in ("traceback", "losses", "grad_norms", "entropy",
                                                                    "per_gpu", "peak_tensors")}
            print(json.dumps(summary), flush=True)
            # Written after every process: a run cut short keeps what it measured.
            (out / f"{file_stem(args, result['model'], result['loop'])}.json").write_text(json.dumps(record, indent=2))
    for (model, loop), record in records.items():
        if record["results"]:
            print_table(record)
        if not any("error" not in r for r in record["results"]):
            continue
        stem = file_stem(args, model, loop)
        plot(record, out / f"{stem}.png")
        print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}")
    measured = [r for record in records.values() for r in record["results"] if "error" not in r]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
