"""tigon bench e2e's smoke run (--smoke): tiny models of every family trained by Hugging Face and
tigon giving the same losses in fp32, TRL's SFT and GRPO loops with TRL's head and tigon's, FSDP2 on
two gloo processes against one process, the jobs as the command plans them, and the combinations
it refuses by name."""

import argparse
import json
import math

import pytest
import torch

from tigon.bench import main
from tigon.bench.e2e import FULL_TIGON, Job, job_args, parse_args, plan_jobs, run_job
from tigon.bench.e2e_models import build_model, with_lora
from utils import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"


def smoke_args(*argv: str) -> argparse.Namespace:
    """The command's options for ``argv`` after ``--smoke``: one warm-up and one timed step."""
    return parse_args(["--smoke", "--warmup", "1", "--steps", "1", *argv])[1]


@pytest.mark.parametrize("model", ["qwen2_5_vl", "deepseek_v3", "gpt_oss"])
def test_each_family_trains_as_hugging_face_with_tigon(model, hugging_face_modules_restored):
    # In this process, Hugging Face's setup first (tigon's patches are global until the fixture
    # restores them), as the command runs each setup in a process of its own.
    args = smoke_args("--model", model)
    hf, tigon = (run_job(args, Job("train", model, setup), DEVICE) for setup in ("hf", "tigon"))
    for result in (hf, tigon):
        assert "error" not in result, result["traceback"]
        # The warm-up step, the timed one and, on a GPU, the one that records each phase's peak.
        assert len(result["losses"]) == 2 + ON_GPU and all(math.isfinite(loss) for loss in result["losses"])
        assert result["tokens_per_second"] > 0 and result["layers"] == 2
    # The same weights and batches: tigon's kernels in fp32 give Hugging Face's losses.
    assert tigon["losses"] == pytest.approx(hf["losses"], rel=1e-5)
    if model == "qwen2_5_vl":
        assert hf["image_side"] == 168
    else:
        assert hf["experts"].endswith("(grouped_mm)") and tigon["experts"].endswith("(tigon)"), tigon["experts"]
    assert hf["attention"] == ("eager" if model == "gpt_oss" and not ON_GPU else
                               "flex_attention" if model == "gpt_oss" else "sdpa")


def test_lora_on_the_experts_trains_as_hugging_face_with_tigon(hugging_face_modules_restored):
    args = smoke_args("--model", "qwen3_moe", "--lora")
    adapted = with_lora(build_model("hf", 2, DEVICE, model="qwen3_moe", dtype=torch.float32, tiny=True))
    adapters = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in adapted.named_parameters() if ".lora_" in name}
    assert {"q_proj", "o_proj", "experts", "base_layer"} <= adapters, adapters  # both stacked weights of the experts
    hf, tigon = (run_job(args, Job("train", "qwen3_moe", setup), DEVICE) for setup in ("hf", "tigon"))
    for result in (hf, tigon):
        assert "error" not in result, result["traceback"]
        assert result["lora"] == "LoRA" and result["label"].endswith("+ PEFT LoRA")
    assert tigon["experts"].endswith("(tigon)")
    assert tigon["losses"] == pytest.approx(hf["losses"], rel=1e-5)


@pytest.fixture
def trl_head_restored():
    """patch_trl() replaces TRL's fused LM head for the whole process: the test leaves TRL's own."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from tigon.trl import unpatch_trl

    yield
    unpatch_trl()


@pytest.mark.slow
def test_trl_loops_compare_trl_and_tigon_heads(hugging_face_modules_restored, trl_head_restored):
    args = smoke_args("--trl", "sft", "grpo", "--seq-len", "16", "--prompt-len", "4")
    sft, grpo = {}, {}
    for setup in ("hf", "tigon_head"):  # TRL's head first: patch_trl() is global
        sft[setup] = run_job(args, Job("sft", "llama", setup), DEVICE)
        grpo[setup] = run_job(args, Job("grpo", "llama", setup), DEVICE)
    for result in (*sft.values(), *grpo.values()):
        assert "error" not in result, result["traceback"]
        assert result["tokens_per_second"] > 0
    assert sft["hf"]["head"] == "TRL" and sft["tigon_head"]["head"] == "tigon"
    # SFT's loss is a mean of log-probs: tigon's head keeps computing its gradients in the forward pass.
    assert sft["tigon_head"]["head_mode"] == "gradients in forward"
    assert len(sft["hf"]["losses"]) == 2  # the warm-up step and the timed one, as the trainer logged them
    assert sft["tigon_head"]["losses"] == pytest.approx(sft["hf"]["losses"], rel=1e-4)
    # GRPO's per-token weights differ between sequences: the head learns to recompute in backward.
    assert grpo["tigon_head"]["head_mode"] == "recomputing backward"
    assert grpo["hf"]["prompt_len"] == 4
    for key in ("mean_log_prob", "mean_entropy", "grad_norm"):
        assert grpo["tigon_head"][key] == pytest.approx(grpo["hf"][key], rel=1e-4), key


@pytest.mark.slow
def test_fsdp2_on_two_processes_trains_as_one(tmp_path):
    # Hugging Face's setup only (no Triton interpreter): one torchrun launch of two gloo processes,
    # then one process; ~20 s, mostly imports.
    argv = ["e2e", "--smoke", "--gpus", "2", "1", "--setups", "hf", "--warmup", "0", "--steps", "2",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    record = json.loads((tmp_path / "e2e_llama_fsdp2.json").read_text())
    assert (tmp_path / "e2e_llama_fsdp2.png").is_file()
    sharded, single = sorted(record["results"], key=lambda r: -r["gpus"])
    assert "error" not in sharded and "error" not in single, record["results"]
    assert (sharded["gpus"], single["gpus"], len(sharded["per_gpu"])) == (2, 1, 2)
    assert sharded["label"] == "Hugging Face, 2 GPUs (FSDP2)"
    # Rank 0 draws the batches one process draws, from the same weights: the first step's loss is
    # the same; the second follows an update by both ranks' gradients.
    assert sharded["losses"][0] == pytest.approx(single["losses"][0], rel=1e-6)
    assert sharded["per_gpu"][0]["losses"] != sharded["per_gpu"][1]["losses"], "each rank its own batch"
    assert sharded["speedup_vs_hf"] == single["speedup_vs_hf"] == 1.0  # each against hf on as many GPUs


def test_jobs_group_by_setup_in_a_smoke_run_hugging_face_first():
    _, args = parse_args(["--smoke", "--model", "llama", "gpt_oss", "--setups", "tigon", "hf", "--gpus", "2", "1"])
    groups = plan_jobs(args)
    assert [[str(job) for job in group] for group in groups] == [
        ["train:llama:hf:2", "train:gpt_oss:hf:2"], ["train:llama:tigon:2", "train:gpt_oss:tigon:2"],
        ["train:llama:hf:1", "train:gpt_oss:hf:1"], ["train:llama:tigon:1", "train:gpt_oss:tigon:1"],
    ]
    _, args = parse_args(["--lora"])
    assert [[job.setup for job in group] for group in plan_jobs(args)] == [["hf"], ["liger"], ["tigon"], [FULL_TIGON]]
    _, args = parse_args(["--trl", "sft", "grpo"])
    assert [str(group[0]) for group in plan_jobs(args)] == [
        "sft:llama:hf:1", "sft:llama:liger:1", "sft:llama:tigon:1",
        "grpo:llama:hf:1", "grpo:llama:tigon_head:1", "grpo:llama:tigon:1",
    ]


@pytest.mark.slow
def test_fp8_setups_train_as_torchao_does_with_tigon(hugging_face_modules_restored):
    pytest.importorskip("torchao.float8")
    args = smoke_args("--fp8", "rowwise")
    assert [job.setup for group in plan_jobs(args) for job in group] == ["hf", "hf_fp8", "tigon", "tigon_fp8"]
    hf_fp8, tigon_fp8 = (run_job(args, Job("train", "llama", setup), DEVICE) for setup in ("hf_fp8", "tigon_fp8"))
    for result in (hf_fp8, tigon_fp8):
        assert "error" not in result, result["traceback"]
        assert result["fp8"] == "rowwise" and result["label"].endswith("+ torchao float8")
    # FP8 in both, the fused loss's chunked head against torchao's: FP8 rounding apart, the same.
    assert tigon_fp8["losses"] == pytest.approx(hf_fp8["losses"], rel=2e-3)


def test_sizes_default_per_loop_and_model():
    _, args = parse_args(["--trl", "sft", "--steps", "3"])
    sizes = job_args(args, Job("sft", "llama", "hf"))
    assert (sizes.layers, sizes.batch, sizes.seq_len, sizes.warmup, sizes.steps) == (4, 4, 4096, 3, 3)
    assert sizes.max_search == 0
    _, args = parse_args([])
    assert job_args(args, Job("train", "llama_1b", "hf")).layers == 16
    assert job_args(args, Job("train", "llama", "hf")).max_search == 65536
    assert job_args(args, Job("train", "gpt_oss", "hf")).max_search == 0
    assert job_args(args, Job("train", "llama", "hf", gpus=2)).max_search == 0
    _, compiled = parse_args(["--compile"])
    assert job_args(compiled, Job("train", "llama", "hf")).max_search == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trl", "sft", "--model", "qwen2_5_vl"], "--trl trains the Llama models only"),
        (["--trl", "grpo", "--lora"], "--trl and --lora do not combine"),
        (["--trl", "sft", "--gpus", "2"], "--trl and --gpus above 1 do not combine"),
        (["--setups", "tigon_head"], "the tigon_head setup patches TRL's head: it needs --trl"),
        (["--gpus", "2", "--budget", "hf"], "--gpus above 1 and --budget do not combine"),
        (["--gpus", "0"], "--gpus takes counts of at least 1"),
        (["--smoke", "--cuda-graph"], "--cuda-graph measure(s) a GPU: not with --smoke"),
        (["--lora", "--model", "deepseek_v3"], "--lora trains the Llama models and Qwen3-MoE only"),
        (["--qlora", "--model", "qwen3_moe"], "--qlora trains the Llama models only"),
        (["--steps", "0"], "--steps takes at least 1"),
        (["--setups", "hf", "tigon_fp8"], "the tigon_fp8 setup(s) train in FP8: they need --fp8 RECIPE"),
        (["--fp8", "rowwise", "--lora"], "--fp8 and --lora do not combine (yet)"),
        (["--fp8", "rowwise", "--gpus", "2"], "--fp8 and --gpus above 1 do not combine (yet)"),
        (["--compile", "--cuda-graph"], "--compile and --cuda-graph do not combine"),
        (["--smoke", "--compile"], "--compile measure(s) a GPU: not with --smoke"),
    ],
)
def test_combinations_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["e2e", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
