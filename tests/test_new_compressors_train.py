"""The sign, ternary and quantised all-reduce compressors train the quick-start digits model in real
2-process DDP (gloo): within 2 points of plain DDP; signSGD's majority vote with error feedback too, the
paper's plain vote and Signum more slowly (below)."""

from __future__ import annotations

import pytest
import torch

from tests._processes import run_gloo

WITHIN_TWO_POINTS = ["efsignsgd", "terngrad", "int8", "int4", "fp8", "signsgd+ef"]
SETTINGS = {"signsgd+ef": ("signsgd", {}, True), "signum": ("signsgd", {"momentum": 0.9}, None)}


@pytest.mark.multiprocess
def test_each_trains_digits_like_ddp(tmp_path) -> None:
    from tests._gloo_workers import train_digits_with_each

    out = tmp_path / "accuracies.pt"
    run_gloo(train_digits_with_each, 2, [*WITHIN_TWO_POINTS, "signsgd", "signum"], str(out), 10, SETTINGS)
    accuracies = torch.load(out)
    for name in WITHIN_TWO_POINTS:
        assert accuracies[name] >= accuracies["ddp"] - 0.02, (name, accuracies)
    # With two workers a majority vote ties (and moves nothing) wherever their signs differ, so the paper's
    # signSGD learns more slowly at SGD's settings (measured: 74% against 91% after 10 epochs), Signum a
    # little faster (81%); with error feedback (what the vote drops locally comes back) it matches DDP.
    assert accuracies["signsgd"] >= 0.6, accuracies
    assert accuracies["signum"] >= accuracies["signsgd"], accuracies
