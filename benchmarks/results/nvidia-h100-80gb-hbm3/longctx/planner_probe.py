"""Scratch (not committed): long-context steps of Llama-3.1-8B shapes with PEFT LoRA, batch 1."""
import argparse, gc, json, os, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
from tigon.transformers import apply_tigon, set_checkpointing, fit_checkpointing, offload_host_bytes

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=32)
p.add_argument("--lengths", type=int, nargs="+")
p.add_argument("--setup", default="tigon")  # tigon | offload | auto | hf
p.add_argument("--steps", type=int, default=2)
p.add_argument("--cap", type=float, default=80)
p.add_argument("--full", action="store_true")
p.add_argument("--model", default="8b")
a = p.parse_args()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap * 2**30 / total))
shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256) if a.model == "8b" else \
    dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
cfg = LlamaConfig(**shape, num_hidden_layers=a.layers, max_position_embeddings=1 << 20, rope_theta=500000.0, attn_implementation="sdpa", dtype=torch.bfloat16)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
model.config.use_cache = False
if a.setup != "hf":
    apply_tigon(model, mlp_tile_tokens="auto" if a.setup in ("offload",) else None)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
if not a.full:
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
    if a.setup != "hf":
        apply_tigon(model, mlp_tile_tokens="auto" if a.setup == "offload" else None)
model.train()
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5, fused=True)
if a.setup == "offload":
    set_checkpointing(model, 0, offload=True)
for T in a.lengths:
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    rec = {"setup": a.setup, "T": T, "layers": a.layers, "full": a.full, "model": a.model}
    try:
        if a.setup == "auto":
            t0 = time.perf_counter()
            plan = fit_checkpointing(model, batch, a.cap - 2, optimizer=opt, offload="auto")
            rec["plan"] = {k: v for k, v in plan.__dict__.items()}
            rec["plan_s"] = time.perf_counter() - t0
        times = []
        torch.cuda.reset_peak_memory_stats()
        for s in range(a.steps):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        rec.update(ok=True, loss=loss.item(), step_s=times, tok_s=T / min(times), peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   host_gib=offload_host_bytes(model) / 2**30)
        del loss
    except torch.OutOfMemoryError as e:
        rec.update(ok=False, error="OOM")
    opt.zero_grad(set_to_none=True); gc.collect(); torch.cuda.empty_cache()
    print(json.dumps(rec, default=str), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.jsonl"), "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
