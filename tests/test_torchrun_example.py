"""examples/torchrun_digits.py: plain PyTorch DDP + ``lightning_gradcomp.register`` under a real torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._processes import run_torchrun

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parents[1] / "examples" / "torchrun_digits.py"


def _torchrun(tmp_path: Path, *args: str) -> str:
    return run_torchrun(EXAMPLE, tmp_path, *args)


def _ranks(prefix: Path) -> list[dict]:
    return [torch.load(f"{prefix}.rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_interrupted_and_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    checkpoint = tmp_path / "digits.pt"
    whole_output = _torchrun(tmp_path, "--epochs", "3", "--out", str(tmp_path / "whole"))
    _torchrun(tmp_path, "--epochs", "3", "--stop-after", "1", "--checkpoint", str(checkpoint))
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 1 and saved["gradcomp"]["world_size"] == 2
    assert not torch.equal(*(r["memory"]["residuals"]["0.weight"] for r in saved["gradcomp"]["ranks"]))
    resumed_output = _torchrun(tmp_path, "--epochs", "3", "--checkpoint", str(checkpoint), "--out",
                               str(tmp_path / "resumed"))
    assert "resumed from" in resumed_output and "epoch 2: last step sent" in resumed_output
    for whole, resumed in zip(_ranks(tmp_path / "whole"), _ranks(tmp_path / "resumed")):
        assert whole["residual_norm"] == resumed["residual_norm"]
        assert whole["totals"] == resumed["totals"]
        assert whole["params"].keys() == resumed["params"].keys()
        assert all(torch.equal(whole["params"][k], resumed["params"][k]) for k in whole["params"])
    assert "gradcomp summary" in whole_output and "measured ratio           33.3x" in whole_output
    assert "est. time saved" in whole_output
