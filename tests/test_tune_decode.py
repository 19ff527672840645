"""benchmarks/tune_decode.py on a machine without a GPU: its config stand-in."""

import torch

import tune_decode  # benchmarks/, on the path from conftest
from flashtile.ops.decode import configs


def test_fixed_config_is_not_switched(monkeypatch):
    """A swept candidate runs as given, with its own split count, even where ``config_and_splits`` would switch it
    (the few-programs config at a 1k cache: one key tile per split)."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda, few = torch.device("cuda", 0), configs.DecodeConfig(128, 8, 3, programs_per_sm=1)
    assert configs.config_and_splits(0, cuda, 128, 8, False, 1024)[0] == configs.CUDA_HEAD_DIM_128
    assert tune_decode.fixed(few)(0, cuda, 128, 8, False, 1024) == (few, 8)
    assert tune_decode.fixed(few)(3, cuda, 128, 8, False, 1024) == (few, 3)
