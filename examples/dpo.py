"""Direct preference optimisation of a small Llama with tigon's FusedLinearDPOLoss and a reference model.

The loss reads the policy's and the reference's last hidden states and their LM heads, and never
builds either model's logits. The model is tiny and built from a config (random weights; no
download) and the preference data is synthetic: every prompt is a run of tokens counting upwards,
the chosen answer continues the count and the rejected answer is random tokens. So the script
runs anywhere (on CPU through Triton's interpreter in about a minute) and the effect is visible:
the policy's reward margin over the reference grows and it learns to prefer the counting answer.

    python examples/dpo.py                                          # tiny, CPU or GPU
    python examples/dpo.py --hidden-size 1024 --layers 8 --vocab-size 32000 --steps 100
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tigon.losses import FusedLinearDPOLoss

IGNORE_INDEX = -100


def preference_batch(n_pairs: int, prompt_len: int, answer_len: int, vocab_size: int, generator: torch.Generator):
    """``input_ids [2B, T]`` (the B chosen sequences, then the B rejected ones) and ``target [2B, T]``
    aligned with the hidden states: position t is scored on token t + 1, the prompt is masked."""
    starts = torch.randint(0, vocab_size, (n_pairs, 1), generator=generator)
    counting = (starts + torch.arange(prompt_len + answer_len)) % vocab_size
    rejected = counting.clone()
    rejected[:, prompt_len:] = torch.randint(0, vocab_size, (n_pairs, answer_len), generator=generator)
    input_ids = torch.cat((counting, rejected))
    target = torch.full_like(input_ids, IGNORE_INDEX)
    target[:, prompt_len - 1 : -1] = input_ids[:, prompt_len:]
    return input_ids, target


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--answer-len", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=4, help="preference pairs per step")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    policy = LlamaForCausalLM(config).to(device, dtype)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    dpo = FusedLinearDPOLoss(beta=args.beta)
    generator = torch.Generator().manual_seed(1)

    for step in range(1, args.steps + 1):
        input_ids, target = preference_batch(args.pairs, args.prompt_len, args.answer_len, args.vocab_size, generator)
        input_ids, target = input_ids.to(device), target.to(device)
        # The decoders' last hidden states; each model's head is applied inside the loss.
        hidden = policy.model(input_ids=input_ids).last_hidden_state
        with torch.no_grad():
            ref_hidden = reference.model(input_ids=input_ids).last_hidden_state
        loss, metrics = dpo(hidden, policy.lm_head.weight, target, ref_input=ref_hidden,
                            ref_weight=reference.lm_head.weight)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        margin = metrics["reward_margins"].mean().item()
        accuracy = (metrics["reward_margins"] > 0).float().mean().item()
        print(f"step {step:3d}  loss {loss.item():.4f}  reward margin {margin:+.4f}  accuracy {accuracy:.2f}")
    return {"loss": loss.item(), "reward_margin": margin, "accuracy": accuracy}


if __name__ == "__main__":
    main()
