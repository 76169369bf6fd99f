"""The DPO example trains as a user would run it: the policy learns to prefer the chosen answers."""

import math
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dpo.py"


def test_dpo_example_learns_the_preference():
    main = runpy.run_path(str(EXAMPLE))["main"]
    final = main(["--steps", "6"])
    # At step 1 the policy equals the reference: loss log 2, margin 0.
    assert final["loss"] < math.log(2) - 0.05
    assert final["reward_margin"] > 0.05 and final["accuracy"] == 1.0
