"""Reinforcement learning with TRL's GRPOTrainer, the policy's layers and its LM head computed by tigon.

The recipe: ``apply_tigon(model)`` (tigon's RMSNorm, SwiGLU MLP and RoPE), then ``patch_trl()``,
then build and run ``GRPOTrainer`` as usual. GRPO samples a group of completions per prompt,
scores them with the reward functions, and raises the log-probability of the completions that
score above their group's mean; those log-probs (and the entropy it logs) come from TRL's fused
LM head, which after ``patch_trl()`` is tigon's ``fused_linear_logprobs``.

Everything is in memory: a tiny Llama built from a config, a character-level tokenizer (one token
per letter or space), prompts cut from the corpus that ships with tigon, and a rule for a reward:
the share of the completion's characters that are the target letter. Within 15 steps the policy
learns to write it most of the time. The printed loss is small and often 0: on a first pass over
its completions GRPO's loss is minus the token-weighted mean of the advantages, which average to 0
within each group; its gradient, not its value, moves the policy. On CPU through Triton's
interpreter it runs in a minute or two, on a GPU in seconds. For a real checkpoint, load it with
``AutoTigonForCausalLM.from_pretrained(path_or_id)`` (in place of ``apply_tigon``) and its
tokenizer with ``AutoTokenizer``.

    python examples/grpo_trl.py                      # tiny, CPU or GPU
    python examples/grpo_trl.py --no-tigon           # the same run, plain TRL and Hugging Face
    python examples/grpo_trl.py --hidden-size 256 --layers 4 --steps 200 --target o
"""

from __future__ import annotations

import argparse
import re
import string
import tempfile
from importlib import resources

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, PrinterCallback, TrainerCallback, set_seed,
)
from trl import GRPOConfig, GRPOTrainer

from tigon.transformers import apply_tigon
from tigon.trl import patch_trl

ALPHABET = " " + string.ascii_lowercase


def character_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``ALPHABET``, and ``<pad>``, ``<eos>``, ``<unk>``."""
    vocab = {token: index for index, token in enumerate(["<pad>", "<eos>", "<unk>", *ALPHABET])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def corpus_prompts(words: int = 3) -> list[str]:
    """The first ``words`` words of each sentence of tigon's bundled corpus, in lower case."""
    text = resources.files("tigon").joinpath("data/corpus.txt").read_text(encoding="utf-8").lower()
    prompts = []
    for sentence in re.split(r"[.!?\n]+", text):
        sentence_words = re.sub(r"[^a-z ]", " ", sentence).split()
        if len(sentence_words) >= words:
            prompts.append(" ".join(sentence_words[:words]) + " ")
    return prompts


def target_share(target: str):
    """The reward: the share of a completion's characters that are ``target``."""

    def reward(completions, **_) -> list[float]:
        return [completion.count(target) / max(1, len(completion)) for completion in completions]

    reward.__name__ = f"share_of_{target}"
    return reward


class PrintStep(TrainerCallback):
    """One line a step, in place of the Trainer's dictionary of every metric."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']:.6f}, reward {logs['reward']:.4f}, "
                  f"entropy {logs['entropy']:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--target", default="e", choices=list(string.ascii_lowercase), help="the rewarded letter")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4, help="completions sampled per prompt")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tigon", action="store_true", help="plain TRL and Hugging Face")
    parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary folder)")
    args = parser.parse_args()

    tokenizer = character_tokenizer()
    train_dataset = Dataset.from_dict({"prompt": corpus_prompts()})
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64) * 2,
        num_key_value_heads=max(1, args.hidden_size // 64), max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )
    # The same weights with and without --no-tigon.
    set_seed(args.seed)
    model = LlamaForCausalLM(config)
    if not args.no_tigon:
        apply_tigon(model)  # RMSNorm, SwiGLU MLP and RoPE
        patch_trl()  # the LM head of every TRL trainer built from now on
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{len(train_dataset)} prompts; norm layer: {type(model.model.norm).__name__}")

    on_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as scratch:
        grpo_config = GRPOConfig(
            output_dir=args.output_dir or scratch,
            num_generations=args.num_generations,
            per_device_train_batch_size=args.prompts_per_step * args.num_generations,
            max_completion_length=args.max_completion_length,
            max_steps=args.steps,
            learning_rate=args.lr,
            logging_steps=1,
            save_strategy="no",
            # TRL's configs default to bf16, also on CPU.
            bf16=on_gpu and torch.cuda.is_bf16_supported(),
            use_cpu=not on_gpu,
            seed=args.seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
            report_to=[],
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=target_share(args.target),
            args=grpo_config,
            train_dataset=train_dataset,
            processing_class=tokenizer,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(PrintStep())
        trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    quarter = max(1, len(rewards) // 4)
    print(f"mean reward of the first {quarter} steps {sum(rewards[:quarter]) / quarter:.4f}, "
          f"of the last {quarter} {sum(rewards[-quarter:]) / quarter:.4f}")


if __name__ == "__main__":
    main()
