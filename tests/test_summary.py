"""The end-of-training summary and the plain-PyTorch entry point's argument checks."""

from __future__ import annotations

import pytest
from torch import nn

import lightning_gradcomp
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.summary import dense_time, format_summary
from lightning_gradcomp.metrics.tally import CollectiveTally


def _step(nbytes: int) -> StepStats:
    return StepStats(steps=1, buckets=2, bytes_sent=2 * nbytes, bytes_dense=400_000, elements_sent=1000,
                     elements_total=100_000, collectives=[("all_gather", nbytes), ("all_reduce", nbytes)])


def test_tally_prices_every_collective_and_survives_a_checkpoint() -> None:
    tally, totals = CollectiveTally(), StepStats()
    for _ in range(10):
        tally.add(_step(4000))
        totals.add(_step(4000))
    network = Network(bandwidth_gbps=1.0, latency_us=50)
    expected = 10 * (network.all_gather_time(4000, 4) + network.all_reduce_time(4000, 4))
    assert tally.time(network, 4) == pytest.approx(expected)
    assert CollectiveTally.from_state_dict(tally.state_dict()).counts == tally.counts
    assert dense_time(totals, network, 4) == pytest.approx(20 * network.all_reduce_time(200_000, 4))


def test_summary_table_reports_ratio_density_error_and_time_saved() -> None:
    totals = StepStats()
    for _ in range(10):
        totals.add(_step(4000))
    text = format_summary("TopK(density=0.01)", 4, totals)
    assert "measured ratio           50.0x" in text and "average density          0.01" in text
    assert "not recorded" in text and "est." not in text
    totals.error_sq, totals.grad_sq = 2.0, 8.0
    text = format_summary("TopK(density=0.01)", 4, totals, comm_s=0.5, dense_s=2.0, network=Network(1.0))
    assert "relative 0.25" in text
    assert "0.5 s vs 2 s dense on 1 Gbit/s ring" in text and "1.5 s (4.0x less)" in text


def test_register_refuses_a_model_that_is_not_ddp() -> None:
    with pytest.raises(ValueError, match="`ddp_model` must be a torch.nn.parallel.DistributedDataParallel"):
        lightning_gradcomp.register(nn.Linear(2, 2))


@pytest.mark.parametrize("print_summary", [True, False])
def test_simulated_fit_prints_the_summary_unless_switched_off(print_summary: bool, capsys: pytest.CaptureFixture) -> None:
    import lightning as L

    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=lightning_gradcomp.GradCompSimStrategy(workers=2, print_summary=print_summary))
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    output = capsys.readouterr().out
    assert ("gradcomp summary" in output) is print_summary
    if print_summary:
        assert "workers, steps           2, 3" in output
    with pytest.raises(ValueError, match="`print_summary` must be"):
        lightning_gradcomp.GradCompStrategy(print_summary="yes")
