"""TRL's trainers compute every loss from per-token log-probs of its fused LM head; after
``tigon.trl.patch_trl()`` that head is tigon's ``fused_linear_logprobs``. Each trainer trains a
tiny Llama twice from the same weights and data: plain TRL, then ``apply_tigon(model)`` and
``patch_trl()``. In fp32 every logged step agrees within 1e-5: the loss, the gradient norm and
what TRL reads off the head (log-probs, entropy, top-1 accuracy, KL, rewards of the completions).

The optimizer is plain SGD: Adam's first steps move each weight by about ±lr whatever the size of
its gradient, so rounding noise in near-zero gradients would become differences of lr in the
weights. SGD moves them in proportion to the gradient, and a wrong gradient still shows in the
next step's loss and gradient norm.
"""

import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tigon.transformers import apply_tigon
from tigon.trl import patch_trl, unpatch_trl
from utils import DEVICE, graph_functions, needs_trl_fused_head

pytestmark = needs_trl_fused_head()

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat and looked at the rain",
    "kernels fuse what the framework runs as several passes",
    "one two three four five six seven eight nine ten",
    "zebras and yaks eat grass in the valley at dawn",
    "every token of the vocabulary has a row in the head",
]
PROMPTS = ["the quick", "a cat sat", "one two", "zebras and"]

# The autograd functions of the two heads, as they appear in the graph of the log-probs.
TRL_HEAD = "ChunkedLogProbFunctionBackward"
TIGON_HEAD = "FusedLinearLogprobsFunctionBackward"


def byte_level_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """The 256 bytes, ``<pad>``, ``<eos>`` and merges learned from ``TEXTS``: a vocabulary that is
    not a power of two, so the head's last block of the vocabulary is partial."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS, bpe_trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


TOKENIZER = byte_level_tokenizer()


def tiny_llama(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=TOKENIZER.pad_token_id, bos_token_id=None, eos_token_id=TOKENIZER.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def common_arguments(output_dir, bf16=False) -> dict:
    return dict(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        optim="sgd", learning_rate=0.5,
        # TRL's configs default to bf16 (autocast, also on CPU): fp32 unless a test asks for it.
        bf16=bf16, use_cpu=not torch.cuda.is_available(), seed=0, save_strategy="no", report_to=[], dataloader_num_workers=0,
        disable_tqdm=True,
    )


def vowel_count(completions, **_) -> list[float]:
    return [float(sum(completion.count(vowel) for vowel in "aeiou")) for completion in completions]


def sft_trainer(model, ref_model, output_dir, bf16=False):
    return trl.SFTTrainer(
        model=model, args=trl.SFTConfig(max_length=32, **common_arguments(output_dir, bf16)),
        train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=TOKENIZER,
    )


def dpo_trainer(model, ref_model, output_dir, bf16=False):
    dataset = Dataset.from_dict({
        "prompt": PROMPTS,
        "chosen": [" brown fox", " on the mat", " three four", " eat grass"],
        "rejected": [" lazy dog", " in the rain", " nine ten", " at dawn"],
    })
    return trl.DPOTrainer(
        model=model, ref_model=ref_model, args=trl.DPOConfig(max_length=32, **common_arguments(output_dir, bf16)),
        train_dataset=dataset, processing_class=TOKENIZER,
    )


def kto_trainer(model, ref_model, output_dir, bf16=False):
    # Batches of 2: KTO's KL term pairs each prompt with another example's completion.
    dataset = Dataset.from_dict({
        "prompt": PROMPTS,
        "completion": [" brown fox", " in the rain", " three four", " at dawn"],
        "label": [True, False, True, False],
    })
    return trl.KTOTrainer(
        model=model, ref_model=ref_model, args=trl.KTOConfig(max_length=32, **common_arguments(output_dir, bf16)),
        train_dataset=dataset, processing_class=TOKENIZER,
    )


def grpo_trainer(model, ref_model, output_dir, bf16=False):
    config = trl.GRPOConfig(
        # Two prompts of two completions a step. Steps 1 and 3 sample new completions; step 2 trains
        # again on step 1's (num_iterations=2), so its loss holds the ratio of the updated policy's
        # log-probs to those of the policy that sampled them (the clipped objective's ratio is 1 on a
        # first pass, where that loss only depends on the rewards).
        num_generations=2, max_completion_length=6, num_iterations=2,
        # The head divides its logits by the sampling temperature.
        temperature=0.7,
        **{**common_arguments(output_dir, bf16), "per_device_train_batch_size": 4, "max_steps": 3},
    )
    return trl.GRPOTrainer(
        model=model, reward_funcs=vowel_count, args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=TOKENIZER,
    )


# name -> (builder, whether it takes a reference model)
TRAINERS = {
    "sft": (sft_trainer, False),
    "dpo": (dpo_trainer, True),
    "kto": (kto_trainer, True),
    "grpo": (grpo_trainer, False),
}


def head_functions(model) -> set[str]:
    """The autograd functions behind the log-probs that ``model``'s fused head returns."""
    input_ids = torch.arange(3, 11, device=model.device).unsqueeze(0)
    return graph_functions(model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs)


def train(name: str, tigon: bool, output_dir, bf16: bool = False):
    """The per-step logs of one run, and the functions behind its model's head."""
    build, has_reference = TRAINERS[name]
    # The reference model differs from the policy, so that the first step's preference losses
    # depend on both models' log-probs.
    model, ref_model = tiny_llama(seed=0), tiny_llama(seed=1) if has_reference else None
    if tigon:
        for built in (model, ref_model):
            if built is not None:
                apply_tigon(built)
        patch_trl()
    trainer = build(model, ref_model, output_dir, bf16)
    trainer.train()
    steps = [log for log in trainer.state.log_history if "loss" in log]
    return steps, head_functions(trainer.model)


def measured(log: dict) -> dict:
    """A step's logged values, less its wall-clock time."""
    return {key: value for key, value in log.items() if "time" not in key}


@pytest.mark.parametrize(
    "name", ["sft", "dpo", "kto", pytest.param("grpo", marks=pytest.mark.slow)],
)
def test_trainer_matches_trl(name, tmp_path):
    plain, plain_head = train(name, tigon=False, output_dir=tmp_path / "trl")
    patched, patched_head = train(name, tigon=True, output_dir=tmp_path / "tigon")
    assert TRL_HEAD in plain_head and TIGON_HEAD not in plain_head
    assert TIGON_HEAD in patched_head and TRL_HEAD not in patched_head
    assert len(patched) == len(plain) == (3 if name == "grpo" else 2)
    for step, (plain_log, patched_log) in enumerate(zip(plain, patched), start=1):
        plain_log, patched_log = measured(plain_log), measured(patched_log)
        assert patched_log.keys() == plain_log.keys(), f"step {step}"
        assert patched_log["loss"] == pytest.approx(plain_log["loss"], rel=0, abs=1e-5), f"step {step}"
        # Summed log-probs reach tens: for them 1e-5 is relative.
        assert patched_log == pytest.approx(plain_log, rel=1e-5, abs=1e-5), f"step {step}"


def test_a_model_given_trl_head_follows_patch_and_unpatch():
    model = tiny_llama(seed=0).to(DEVICE)
    trl_utils.add_fused_lm_head(model)
    assert TRL_HEAD in head_functions(model)
    patch_trl()
    functions = head_functions(model)
    assert TIGON_HEAD in functions and TRL_HEAD not in functions
    unpatch_trl()
    assert TRL_HEAD in head_functions(model)


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_bf16_as_close_to_fp32_as_trl(name, tmp_path):
    # Under bf16 autocast both heads round differently; tigon's must stay as close to the fp32
    # run as TRL's own does (the family tests' criterion: 2x its distance, or 2^-10).
    exact, _ = train(name, tigon=False, output_dir=tmp_path / "fp32")
    plain, _ = train(name, tigon=False, output_dir=tmp_path / "trl", bf16=True)
    patched, _ = train(name, tigon=True, output_dir=tmp_path / "tigon", bf16=True)
    for step, (exact_log, plain_log, patched_log) in enumerate(zip(exact, plain, patched), start=1):
        trl_distance = abs(plain_log["loss"] - exact_log["loss"])
        tigon_distance = abs(patched_log["loss"] - exact_log["loss"])
        assert tigon_distance <= max(2 * trl_distance, 2**-10), f"step {step}: {tigon_distance} vs TRL's {trl_distance}"


def test_sft_with_a_peft_config_matches_trl(tmp_path):
    """``SFTTrainer(peft_config=...)`` on a patched model: TRL wraps the model with PEFT after
    tigon's patch, its LoRA layers take tigon's fused path and its head is tigon's; every logged
    step agrees with plain TRL + PEFT within 1e-5."""
    from peft import LoraConfig

    logs, functions = [], []
    for tigon in (False, True):
        model = tiny_llama(seed=0)
        if tigon:
            apply_tigon(model)
            patch_trl()
        trainer = trl.SFTTrainer(
            model=model, args=trl.SFTConfig(max_length=32, **common_arguments(tmp_path / str(tigon))),
            train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=TOKENIZER,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        )
        trainer.train()
        logs.append([measured(log) for log in trainer.state.log_history if "loss" in log])
        functions.append(head_functions(trainer.model))
    assert "LoRALinearFunctionBackward" in functions[1] and "LoRALinearFunctionBackward" not in functions[0]
    assert TIGON_HEAD in functions[1]
    assert len(logs[0]) == len(logs[1]) == 2
    for step, (plain_log, patched_log) in enumerate(zip(*logs), start=1):
        assert patched_log == pytest.approx(plain_log, rel=1e-5, abs=1e-5), f"step {step}"
