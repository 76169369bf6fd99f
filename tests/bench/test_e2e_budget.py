"""tigon bench e2e --budget, --cuda-graph and --model llama_1b: the options refused by name, the 1B
model built with its head tied to the embedding as released, and (on a GPU) the captured training
step trains as the eager one does."""

import pytest
import torch

from tigon.bench import main
from tigon.bench.e2e import captured_train_step, new_optimizer, train_step
from tigon.bench.e2e_models import MODELS, build_model, text_batch
from utils import DEVICE, ON_GPU


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "lots"], "--budget takes 'hf' or a number of GiB, got 'lots'"),
        (["--budget", "-3"], "--budget takes 'hf' or a number of GiB, got '-3'"),
        (["--budget", "hf", "--setups", "liger", "tigon"], "--budget hf needs the hf setup"),
        (["--budget", "30", "--lora"], "--budget trains full fine-tuning only"),
        (["--cuda-graph", "--qlora"], "--cuda-graph trains full fine-tuning only"),
        (["--cuda-graph", "--budget", "hf"], "--cuda-graph and --budget do not combine"),
    ],
)
def test_budget_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["e2e", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_llama_1b_is_the_whole_model_with_a_tied_head(hugging_face_modules_restored):
    assert MODELS["llama_1b"].layers == 16
    model = build_model("hf", 2, DEVICE, model="llama_1b", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


TINY_1B = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("setup", ["hf", "tigon"])
def test_the_captured_step_trains_as_the_eager_step(setup, hugging_face_modules_restored):
    """Replays of the captured step (checkpointing on, capturable fused AdamW) give the losses of
    eager steps on the same batches from the same weights."""
    runs = []
    for captured in (False, True):
        model = build_model(setup, 2, model="llama_1b", **TINY_1B)
        optimizer = new_optimizer(model, "fused", capturable=True)
        generator = torch.Generator(device="cuda").manual_seed(0)
        if captured:
            # Capture takes three warm-up steps (they train), then the first batch drawn for a replay:
            # the eager run takes the same warm-up steps on the same first batch.
            step, _ = captured_train_step(model, optimizer, lambda: text_batch(model.config, 2, 64, generator))
        else:
            warm = text_batch(model.config, 2, 64, generator)
            for _ in range(3):
                model(**warm).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)

            def step():
                return train_step(model, optimizer, text_batch(model.config, 2, 64, generator))

        runs.append([step() for _ in range(3)])
    eager, graphed = runs
    # Within what two identical bf16 runs differ by after a few steps (the embedding's backward
    # accumulates with atomics); a wrong replay (stale batch, gradients not zeroed) is off by far more.
    assert graphed == pytest.approx(eager, rel=1e-3), (eager, graphed)
    assert len(set(graphed)) == 3, "each replay trains on its own batch"
