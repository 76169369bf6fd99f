"""tigon bench e2e --budget and --model llama_1b: the options refused by name, and the 1B model
built with its head tied to the embedding as released."""

import pytest

from tigon.bench import main
from tigon.bench.e2e import MODELS, build_model
from utils import DEVICE


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "lots"], "--budget takes 'hf' or a number of GiB, got 'lots'"),
        (["--budget", "-3"], "--budget takes 'hf' or a number of GiB, got '-3'"),
        (["--budget", "hf", "--setups", "liger", "tigon"], "--budget hf needs the hf setup"),
        (["--budget", "30", "--lora"], "--budget trains full fine-tuning only"),
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
