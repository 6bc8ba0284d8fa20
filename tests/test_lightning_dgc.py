"""DGC and its warm-up in real 2-process Lightning runs."""

from __future__ import annotations

import pytest
import torch

from tests._processes import STEPS_PER_EPOCH

pytestmark = pytest.mark.multiprocess


def test_dgc_at_density_one_equals_momentum_sgd_under_plain_ddp(lightning_runs) -> None:
    ddp, _ = lightning_runs("ddp_momentum", "--strategy", "ddp", "--epochs", "3", "--momentum", "0.9",
                            "--lr", "0.05")
    dgc, _ = lightning_runs("dgc_dense", "--compressor", "dgc", "--epochs", "3", "--lr", "0.05",
                            "--compressor-kwargs", '{"density": 1.0, "momentum": 0.9}')
    for key, value in ddp[0]["params"].items():
        torch.testing.assert_close(dgc[0]["params"][key], value, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(dgc[0]["params"][k], dgc[1]["params"][k]) for k in dgc[0]["params"])


def test_dgc_refuses_an_optimizer_with_momentum(lightning_runs, tmp_path) -> None:
    from tests._processes import run_lightning

    with pytest.raises(AssertionError, match="holds the momentum, but SGD applies momentum=0.9"):
        run_lightning(tmp_path, "refused", "--compressor", "dgc", "--epochs", "1", "--momentum", "0.9", "--devices", "1")


PAPER = [0.25, 0.0625, 0.015625, 0.00390625, 0.001]


def test_warmup_follows_the_paper_sequence_and_resumes_where_it_stopped(lightning_runs) -> None:
    args = ("--compressor", "dgc", "--warmup-epochs", "4", "--lr-warmup")
    ckpt = lightning_runs.root / "warm_half.ckpt"  # written at the end of epoch 2, the run going on
    whole, _ = lightning_runs("warm_whole", *args, "--epochs", "6", "--save", str(ckpt), "--save-at-epoch", "2")
    per_epoch = {}
    for step in whole[0]["steps"]:
        per_epoch.setdefault(step["epoch"], set()).add(step["compressor_density"])
    assert [per_epoch[e] for e in range(6)] == [{d} for d in PAPER] + [{0.001}]
    lrs = [s["lr"] for s in whole[0]["steps"]]
    assert lrs[0] == pytest.approx(0.1 * 0.1) and lrs[-1] == pytest.approx(0.1)
    assert all(a <= b + 1e-12 for a, b in zip(lrs, lrs[1:])), "the learning rate rises monotonically"
    resumed, _ = lightning_runs("warm_resumed", *args, "--epochs", "6", "--resume", str(ckpt))
    assert resumed[0]["steps"] == whole[0]["steps"][2 * STEPS_PER_EPOCH:]
    for a, b in zip(whole, resumed):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
