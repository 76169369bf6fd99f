"""patch_trl with a TRL that has no fused LM head (older than 1.16): it says so and patches
nothing, leaving tigon's layer patches to apply on their own."""

import pytest

import tigon.trl as tigon_trl


def test_patch_trl_without_trl_fused_head_warns_and_patches_nothing(monkeypatch):
    monkeypatch.setattr(tigon_trl, "HAS_FUSED_HEAD", False)
    head = tigon_trl._trl_utils.__dict__.get("_ChunkedLogProbFunction")
    with pytest.warns(tigon_trl.TRLHeadMissingWarning, match=r"TRL \S+ has no fused LM head .*apply_tigon\) still apply"):
        tigon_trl.patch_trl()
    assert tigon_trl._trl_utils.__dict__.get("_ChunkedLogProbFunction") is head
    assert not tigon_trl.is_patched()
    tigon_trl.unpatch_trl()  # and undoing it changes nothing either
    assert tigon_trl._trl_utils.__dict__.get("_ChunkedLogProbFunction") is head
