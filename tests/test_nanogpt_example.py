"""examples/nanogpt_train.py: a nanoGPT-shaped third-party loop (gradient accumulation through
``require_backward_grad_sync``, rank-0-only evaluation and checkpoints, resume) under a real torchrun,
with ``register()`` and with ``local_updates()`` (issue 36): the ranks agree at the end, and a run
resumed from a checkpoint written inside a window ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._processes import run_torchrun

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parents[1] / "examples" / "nanogpt_train.py"
COMMON = ["--max-iters", "12", "--eval-interval", "4"]  # 13 optimizer steps; checkpoints at 4, 8 and 12


def _torchrun(cwd: Path, *args: str) -> str:
    return run_torchrun(EXAMPLE, cwd, *args)


def _ranks(prefix: Path) -> list[dict]:
    return [torch.load(f"{prefix}.rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def _assert_ranks_agree(ranks: list[dict]) -> None:
    for name, value in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], value), name


def test_register_with_gradient_accumulation_ends_with_the_ranks_agreeing(tmp_path: Path) -> None:
    output = _torchrun(tmp_path, "--mode", "register", "--compressor", "int8", *COMMON, "--out-dir",
                       str(tmp_path / "out"), "--result", str(tmp_path / "register"))
    ranks = _ranks(tmp_path / "register")
    assert ranks[0]["iter_num"] == 13
    _assert_ranks_agree(ranks)
    saved = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)
    assert saved["iter_num"] == 12 and len(saved["gradcomp"]["ranks"]) == 2
    assert "gradcomp summary" in output


def test_local_updates_resume_inside_a_window_exactly_and_end_on_the_global_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    local = ["--mode", "local", "--compressor", "topk", "--sync-every", "3", *COMMON, "--out-dir", str(out)]
    output = _torchrun(tmp_path, *local, "--keep-checkpoints", "--result", str(tmp_path / "whole"))
    saved = torch.load(out / "ckpt-8.pt", weights_only=False)
    outer = saved["gradcomp"]["ranks"][0]["local"]["outer"]
    assert saved["iter_num"] == outer["optimizer_steps"] == 8, "8 % 3 == 2: inside a window"
    for name, glob in outer["global"].items():  # the model rank 0 saved is θ_global
        assert torch.equal(saved["model"][name], glob), name
    _torchrun(tmp_path, *local, "--init-from", "resume", "--resume-from", "ckpt-8.pt",
              "--result", str(tmp_path / "resumed"))
    whole, resumed = _ranks(tmp_path / "whole"), _ranks(tmp_path / "resumed")
    _assert_ranks_agree(whole)
    for rank in (0, 1):
        assert whole[rank]["iter_num"] == resumed[rank]["iter_num"] == 13
        for name, value in whole[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), (rank, name)
    assert "5 synchronisations in 13 optimizer steps" in output, "4 windows, then the final sync()"
