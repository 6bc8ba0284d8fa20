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


@pytest.mark.parametrize("workers", [2, 4])
def test_the_summary_of_an_int8_run_reports_the_bytes_that_leave_each_worker(workers: int) -> None:
    """The summary reads the totals that ``step_stats`` adds up: for int8, the bytes each worker sends (the
    all-to-all's own chunk stays), 3.9x fewer than DDP's fp32 all-reduce at every N (2.6x at N = 2 when
    the own chunk was counted)."""
    import torch

    from lightning_gradcomp.compressors import Int8AllReduce
    from lightning_gradcomp.simulation import SimulatedExchange

    exchange = SimulatedExchange(Int8AllReduce(), workers)
    for step in range(3):
        for worker in range(workers):
            exchange.add_worker(worker, [("w", torch.randn(64, 1024))])
        exchange.finish_step()
    totals = exchange.totals
    assert totals.bytes_sent == 3 * exchange.step_stats.bytes_sent
    assert totals.compression_ratio == pytest.approx(exchange.step_stats.compression_ratio)
    text = format_summary(repr(exchange.compressor), workers, totals)
    assert "measured ratio           3.9x" in text, text
    assert f"bytes sent / worker      {3 * 66568 / 1e3:.2f} kB (dense DDP: 786.43 kB)" in text, text


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


def test_the_every_step_reference_of_streaming_diloco_is_the_whole_model(capsys: pytest.CaptureFixture) -> None:
    """With 2 fragments each synchronisation exchanges one of them, so ``bytes_dense`` per synchronisation is
    about half the model: the "DDP fp32 exchanging every step" reference is the whole model's fp32 bytes times
    the optimizer steps (it read about half, and the ratio against DDP half the true one)."""
    import lightning as L

    from lightning_gradcomp import LocalUpdates
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule
    from lightning_gradcomp.metrics.summary import _bytes

    model = DigitsClassifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=lightning_gradcomp.GradCompSimStrategy(
                            workers=2, compressor="int8", local_updates=LocalUpdates(4, fragments=2)))
    trainer.fit(model, datamodule=DigitsDataModule())
    whole = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad) * 8
    assert f"DDP fp32 exchanging every step: {_bytes(whole)})" in capsys.readouterr().out
