"""Real 2-process Lightning runs (popen launcher, gloo) on scikit-learn's digits."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.exchange.checkpoint import gather_parts
from tests._processes import EPOCHS, STEPS_PER_EPOCH, params_equal

pytestmark = pytest.mark.multiprocess


def test_none_gives_parameters_identical_to_plain_ddp(lightning_runs) -> None:
    ddp, _ = lightning_runs("ddp", "--strategy", "ddp", "--epochs", EPOCHS, "--test")
    none, _ = lightning_runs("none", "--compressor", "none", "--epochs", EPOCHS)
    assert ddp[0]["global_step"] == none[0]["global_step"] == 10 * STEPS_PER_EPOCH
    assert params_equal(ddp[0]["params"], none[0]["params"])
    assert params_equal(none[0]["params"], none[1]["params"])


def test_topk_hook_runs_every_step_and_accuracy_is_within_two_points(lightning_runs) -> None:
    ddp, _ = lightning_runs("ddp", "--strategy", "ddp", "--epochs", EPOCHS, "--test")
    topk, output = lightning_runs("topk", "--compressor", "topk", "--density", "0.01", "--epochs", EPOCHS, "--test",
                                  "--csv", str(lightning_runs.root / "csv"))
    steps = 10 * STEPS_PER_EPOCH
    assert output.count("gradcomp summary") == 1 and f"workers, steps           2, {steps}" in output
    for rank in topk:
        assert rank["global_step"] == rank["hook_step"] == steps
        assert rank["hook_calls"] >= steps
        assert len(rank["steps"]) == steps
        assert all(s["buckets"] >= 1 and s["bytes_sent"] > 0 for s in rank["steps"]), "the hook ran on every step"
        assert [s["hook_step"] for s in rank["steps"]] == list(range(1, steps + 1))
    assert params_equal(topk[0]["params"], topk[1]["params"]), "ranks hold identical parameters"
    first = topk[0]["steps"][0]
    assert first["bytes_dense"] / first["bytes_sent"] > 25  # biases go dense, so below 50x
    assert topk[0]["test_acc"] >= ddp[0]["test_acc"] - 0.02, (topk[0]["test_acc"], ddp[0]["test_acc"])


def test_step_figures_reach_the_trainer_logger(lightning_runs) -> None:
    lightning_runs("topk", "--compressor", "topk", "--density", "0.01", "--epochs", EPOCHS, "--test",
                   "--csv", str(lightning_runs.root / "csv"))
    (metrics_file,) = (lightning_runs.root / "csv").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    logged = [r for r in rows if r.get("gradcomp/bytes_sent")]
    assert len(logged) == 10 * STEPS_PER_EPOCH // 5
    for key in ("gradcomp/bytes_sent", "gradcomp/bytes_dense", "gradcomp/compression_ratio", "gradcomp/density"):
        assert all(math.isfinite(float(r[key])) for r in logged), key
    ratio = float(logged[0]["gradcomp/compression_ratio"])
    assert ratio == pytest.approx(float(logged[0]["gradcomp/bytes_dense"]) / float(logged[0]["gradcomp/bytes_sent"]))


def _whole_run_saving_at_half(lightning_runs) -> tuple[list[dict], Path]:
    """Four epochs of Top-k, with the checkpoint of the end of epoch 2 (memoised: two tests resume from it)."""
    ckpt = lightning_runs.root / "half.ckpt"
    whole, _ = lightning_runs("whole", "--compressor", "topk", "--epochs", "4", "--save", str(ckpt),
                              "--save-at-epoch", "2")
    return whole, ckpt


def test_resume_continues_as_if_never_stopped(lightning_runs) -> None:
    """From the checkpoint of the end of epoch 2, to the same parameters, residuals and totals as the run that
    wrote it and went on."""
    whole, ckpt = _whole_run_saving_at_half(lightning_runs)
    assert torch.load(ckpt, weights_only=True)["gradcomp"]["parts"] == 2  # nothing gathered on rank 0
    saved = gather_parts(ckpt)
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    assert not torch.equal(*(r["memory"]["residuals"]["net.0.weight"] for r in saved["ranks"])), \
        "each rank's own residuals are saved"
    resumed, _ = lightning_runs("resumed", "--compressor", "topk", "--epochs", "4", "--resume", str(ckpt))
    for a, b in zip(whole, resumed):
        assert a["hook_step"] == b["hook_step"] == 4 * STEPS_PER_EPOCH
        assert a["residual_norm"] == b["residual_norm"]
        assert a["totals"] == b["totals"], "running totals (bytes, density, error) survive the resume"
        assert params_equal(a["params"], b["params"])


def test_resume_with_another_world_size_drops_residuals_with_a_warning(lightning_runs) -> None:
    _, ckpt = _whole_run_saving_at_half(lightning_runs)
    single, output = lightning_runs("single", "--compressor", "topk", "--epochs", "3", "--devices", "1",
                                    "--resume", str(ckpt))
    assert "holds error-feedback memory of 2 workers of TopK, this run has 1 of TopK; the residuals are dropped" in output
    assert single[0]["global_step"] > 2 * STEPS_PER_EPOCH


def test_gradient_accumulation_compresses_once_per_optimizer_step(lightning_runs) -> None:
    runs, _ = lightning_runs("accumulate", "--compressor", "topk", "--epochs", "2", "--accumulate", "2")
    for rank in runs:
        assert rank["global_step"] == 2 * STEPS_PER_EPOCH // 2
        assert rank["hook_step"] == rank["global_step"]
        assert rank["hook_calls"] == rank["global_step"]  # one bucket per step for this small model


def test_two_optimizers_of_one_batch_report_the_batchs_exchange(lightning_runs) -> None:
    """Manual optimization, one backward and two optimizer steps per batch: the strategy's figures of the
    batch (what CompressionMonitor logs) are its exchange's, not the second step's empty ones (issue 36,
    item 8)."""
    runs, _ = lightning_runs("two-optimizers", "--two-optimizers", "--max-steps", "8", "--epochs", "1")
    for rank in runs:
        assert rank["global_step"] == 8 and len(rank["steps"]) == 4  # two optimizer steps per batch
        assert all(s["buckets"] >= 1 and s["bytes_sent"] > 0 for s in rank["steps"]), rank["steps"]
        assert all(s["bytes_dense"] / s["bytes_sent"] > 10 for s in rank["steps"])
    assert params_equal(runs[0]["params"], runs[1]["params"])
