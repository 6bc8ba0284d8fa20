"""Lightning Fabric with the gradcomp strategy: real 2-process runs (popen launcher, gloo), and the
registry and option checks in process."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

import lightning_gradcomp
from lightning_gradcomp import GradCompFabricStrategy, TopK

from tests._processes import EPOCHS, STEPS_PER_EPOCH, params_equal


@pytest.mark.multiprocess
def test_none_gives_parameters_identical_to_fabric_ddp(fabric_runs) -> None:
    ddp, _ = fabric_runs("ddp", "--strategy", "ddp", "--epochs", EPOCHS)
    none, _ = fabric_runs("none", "--strategy", "gradcomp", "--compressor", "none", "--epochs", EPOCHS)
    assert none[0]["hook_step"] == 10 * STEPS_PER_EPOCH
    assert params_equal(ddp[0]["params"], none[0]["params"])
    assert params_equal(none[0]["params"], none[1]["params"])


@pytest.mark.multiprocess
def test_gradcomp_by_name_trains_within_two_points_and_resumes_exactly(fabric_runs) -> None:
    ddp, _ = fabric_runs("ddp", "--strategy", "ddp", "--epochs", EPOCHS)
    ckpt = str(fabric_runs.root / "topk.ckpt")
    topk, _ = fabric_runs("topk", "--strategy", "gradcomp-by-name", "--epochs", EPOCHS, "--save-at", "5",
                          "--save", ckpt)
    for rank in topk:
        assert rank["hook_step"] == 10 * STEPS_PER_EPOCH
        assert len(rank["steps"]) == 10 * STEPS_PER_EPOCH
        assert all(s["buckets"] == 1 and s["bytes_dense"] / s["bytes_sent"] > 25 for s in rank["steps"])
    assert params_equal(topk[0]["params"], topk[1]["params"])
    assert topk[0]["test_acc"] >= ddp[0]["test_acc"] - 0.02, (topk[0]["test_acc"], ddp[0]["test_acc"])
    assert "measured ratio" in topk[0]["summary"] and "TopK(density=0.01" in topk[0]["summary"]

    saved = torch.load(ckpt, weights_only=True)
    assert saved["epoch"] == 5 and saved["gradcomp"]["parts"] == 2 and "ranks" not in saved["gradcomp"]  # nothing
    # gathered on rank 0: each rank wrote its own part
    for rank in (0, 1):
        part = torch.load(f"{ckpt}.gradcomp/rank{rank:05d}.pt", weights_only=True)
        assert part["part"] == rank and part["world_size"] == 2
        assert [state is not None for state in part["ranks"]] == [r == rank for r in (0, 1)]
    resumed, _ = fabric_runs("resumed", "--strategy", "gradcomp-by-name", "--epochs", EPOCHS, "--resume", ckpt)
    for whole, rest in zip(topk, resumed):
        assert rest["hook_step"] == whole["hook_step"]
        assert rest["residual_norm"] == whole["residual_norm"], "each rank's residuals survive the resume"
        assert rest["totals"] == whole["totals"]
        assert params_equal(rest["params"], whole["params"])


def test_fabric_registry_and_bad_options() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="gradcomp")
    assert isinstance(fabric.strategy, GradCompFabricStrategy)
    assert repr(fabric.strategy.compressor) == repr(lightning_gradcomp.get_compressor("topk"))
    assert isinstance(Fabric(accelerator="cpu", devices=2, strategy="gradcomp_spawn").strategy, GradCompFabricStrategy)
    strategy = GradCompFabricStrategy(compressor=TopK(0.001), bucket_cap_mb=1)
    assert strategy.compressor.density == 0.001
    with pytest.raises(ValueError, match="`compressor`"):
        GradCompFabricStrategy(compressor="gzip")
    with pytest.raises(ValueError, match="unknown DistributedDataParallel argument"):
        GradCompFabricStrategy(bucket_size=3)
    with pytest.raises(ValueError, match=r"\['hierarchy'\] are options of the Trainer's GradCompStrategy only"):
        GradCompFabricStrategy(hierarchy="node")
    with pytest.raises(ValueError, match="`start_method` must be one of"):
        GradCompFabricStrategy(start_method="thread")
    with pytest.raises(RuntimeError, match="no model has been set up"):
        strategy.summary()
