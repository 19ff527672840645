"""benchmarks/tune_gluon.py's variant handling (the timing itself needs a Hopper GPU)."""

from __future__ import annotations

import tune_gluon  # benchmarks/, on the path from conftest
from flashtile.ops.sm90 import backward as backward_sm90
from flashtile.ops.sm90 import forward as forward_sm90


def test_variant_keys_reach_the_configs_they_name_and_are_undone(monkeypatch):
    """A plain key changes every forward and backward config that has it; FORWARD_D / BACKWARD_D narrow it to that
    head dim's forward / backward config (both: both), a forward config's CAUSAL_CHANGES with it; GLUON_CAUSAL_D
    runs a head dim's causal forwards of every length on the Gluon kernel (here from a threshold of 2048); all of it
    undone after the block."""
    monkeypatch.setitem(forward_sm90.CAUSAL_MIN_SEQLEN_Q, 64, 2048)
    before = (
        {d: dict(c) for d, c in forward_sm90.CONFIGS.items()},
        {d: dict(c) for d, c in forward_sm90.CAUSAL_CHANGES.items()},
        {d: dict(c) for d, c in backward_sm90.CONFIGS.items()},
        dict(forward_sm90.CAUSAL_MIN_SEQLEN_Q),
    )
    name, changes = tune_gluon.parse_variant("x:STAGES=4")
    assert name == "x" and changes == {"STAGES": 4}
    with tune_gluon.configured(changes):
        assert all(c["STAGES"] == 4 for c in (*forward_sm90.CONFIGS.values(), *backward_sm90.CONFIGS.values()))
    with tune_gluon.configured({"BACKWARD_D": 128, "KEY_PAIRS": 0}):
        assert [c["KEY_PAIRS"] for c in backward_sm90.CONFIGS.values()] == [0, True, True]  # D=128 / 64 / 256
    with tune_gluon.configured({"FORWARD_D": 64, "BACKWARD_D": 128, "CONSUMER_REGS": 200}):
        regs = [c["CONSUMER_REGS"] for c in (*forward_sm90.CONFIGS.values(), *backward_sm90.CONFIGS.values())]
        assert regs == [200, 240, 240, 200, 240, 240]  # forward 64 / 128 / 256, backward 128 / 64 / 256
        assert forward_sm90.config(64, causal=True, seqlen_q=2048)["CONSUMER_REGS"] == 200
    with tune_gluon.configured({"FORWARD_D": 128, "NUM_WG": 3}):
        assert forward_sm90.config(64, causal=True, seqlen_q=2048)["NUM_WG"] == 2  # CAUSAL_CHANGES untouched
        assert forward_sm90.config(128, causal=True, seqlen_q=2048)["NUM_WG"] == 3
    with tune_gluon.configured({"GLUON_CAUSAL_D": 64}):
        assert forward_sm90.CAUSAL_MIN_SEQLEN_Q[64] == 1
    after = (forward_sm90.CONFIGS, forward_sm90.CAUSAL_CHANGES, backward_sm90.CONFIGS, forward_sm90.CAUSAL_MIN_SEQLEN_Q)
    assert after == before
