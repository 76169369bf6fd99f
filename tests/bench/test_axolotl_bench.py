"""``tigon bench axolotl``'s configs and arguments; its runs, which need Axolotl, are in
tests/integrations/test_axolotl.py (.ci/axolotl)."""

import importlib.util
from pathlib import Path

import pytest

from tigon.bench import axolotl


def config(*argv: str, setup: str) -> dict:
    return axolotl.axolotl_config(axolotl.parse_args(list(argv)), Path("/work"), setup)


def test_the_setups_share_one_training_config_and_differ_by_their_plugin_keys():
    configs = {setup: config("--smoke", setup=setup) for setup in axolotl.SETUPS}
    shared = {key for key in configs["axolotl"] if key not in ("plugins", "output_dir")}
    for setup, keys in configs.items():
        assert {key: keys[key] for key in shared} == {key: configs["axolotl"][key] for key in shared}
        assert keys["plugins"][-1] == axolotl.TIMER_PLUGIN and keys["output_dir"] == f"/work/{setup}"
    assert configs["tigon"]["plugins"][0] == "tigon.integrations.axolotl.TigonPlugin"
    assert configs["tigon"]["tigon_lora"] and configs["liger"]["liger_fused_linear_cross_entropy"]
    # Axolotl's own LoRA kernels would replace the layers tigon's keys take: off for every setup.
    assert not configs["axolotl"]["lora_mlp_kernel"] and configs["axolotl"]["adapter"] == "lora"
    assert "adapter" not in config("--smoke", "--adapter", "none", setup="tigon")
    assert "tigon_lora" not in config("--smoke", "--adapter", "none", setup="tigon")


@pytest.mark.skipif(axolotl.torch.cuda.is_available(), reason="without a GPU")
def test_without_a_gpu_the_run_is_the_smoke_run():
    args = axolotl.parse_args(["--seq-len", "4096", "--steps", "12"])
    assert (args.smoke, args.seq_len, args.steps, args.warmup) == (True, 64, 3, 1)


@pytest.mark.parametrize(
    "argv, message",
    [(["--steps", "2", "--warmup", "2"], "must be more than --warmup"),
     (["--samples", "4"], "must be at least --steps")],
)
def test_arguments_that_would_time_nothing_are_refused(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(axolotl.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        axolotl.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("axolotl") is not None, reason="Axolotl is installed here")
def test_without_axolotl_the_command_says_what_to_install(capsys):
    assert axolotl.main(["--smoke"]) == 2
    assert "pip install axolotl==0.21.0" in capsys.readouterr().err
