"""Telemetry: running totals against independent sums, the network model, and a TensorBoard run."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.metrics.netmodel import Network
from tests import _gloo_workers as workers
from tests._processes import run_gloo


@pytest.mark.multiprocess
def test_total_error_bytes_and_density_match_independent_counts() -> None:
    run_gloo(workers.check_telemetry_totals, 2)


def test_ring_all_reduce_of_100_mb_among_4_workers_on_10_gbits() -> None:
    network = Network(bandwidth_gbps=10, latency_us=0)
    # 2 (N-1)/N * S / B = 1.5 * 100e6 B / 1.25e9 B/s = 0.12 s
    assert network.all_reduce_time(100e6, 4) == pytest.approx(0.12)
    with_latency = Network(bandwidth_gbps=10, latency_us=50)
    assert with_latency.all_reduce_time(100e6, 4) == pytest.approx(0.12 + 6 * 50e-6)
    assert network.all_reduce_time(100e6, 1) == 0.0


def test_all_gather_and_parameter_server_formulas() -> None:
    ring = Network(bandwidth_gbps=10, latency_us=10)
    assert ring.all_gather_time(1e6, 8) == pytest.approx(7 * 10e-6 + 7 * 1e6 / 1.25e9)
    ps = Network(bandwidth_gbps=10, latency_us=0, topology="parameter_server")
    # Harris 2020's estimate: push and pull of the payload over one 10 Gbit/s link
    assert ps.all_reduce_time(100e6, 4) == pytest.approx(2 * 100e6 / 1.25e9)
    assert ps.all_gather_time(1e6, 4) == pytest.approx((1e6 + 4e6) / 1.25e9)
    bottleneck = Network(bandwidth_gbps=10, latency_us=0, topology="parameter_server", server_bandwidth_gbps=10)
    assert bottleneck.all_reduce_time(100e6, 4) == pytest.approx(2 * 4 * 100e6 / 1.25e9)
    assert ring.step_time([("all_reduce", 100e6), ("all_gather", 1e6)], 4) == pytest.approx(
        ring.all_reduce_time(100e6, 4) + ring.all_gather_time(1e6, 4))


@pytest.mark.parametrize(
    "kwargs,match",
    [({"bandwidth_gbps": 0}, "`bandwidth_gbps` must be a number > 0"),
     ({"latency_us": -1}, "`latency_us` must be a number >= 0"),
     ({"topology": "mesh"}, "`topology` must be one of ring, parameter_server")],
)
def test_network_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Network(**kwargs)


def test_monitor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="`layer_mode` must be 'scalars' or 'histogram'"):
        CompressionMonitor(layer_mode="table")
    with pytest.raises(ValueError, match="`log_every_n_steps` must be an integer >= 0"):
        CompressionMonitor(log_every_n_steps=-1)


TAGS = ("total_error", "step_error", "relative_error", "average_density", "density", "bytes_sent", "bytes_dense",
        "bytes_sent_total", "bytes_dense_total", "compression_ratio", "compress_ms", "decompress_ms", "comm_ms_est",
        "epoch_compute_s", "epoch_comm_s_est", "epoch_total_s_est")


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor", ["topk", "qsgd"])
def test_two_process_run_writes_every_tag_to_tensorboard(lightning_runs, compressor: str) -> None:
    board = lightning_runs.root / f"tb_{compressor}"
    runs, output = lightning_runs(f"monitored_{compressor}", "--compressor", compressor, "--epochs", "2", "--monitor",
                                  "--tensorboard", str(board))
    # the end-of-fit summary, on rank 0 only, priced on the monitor's network model
    assert output.count("gradcomp summary") == 1
    assert "est. communication" in output and "on 10 Gbit/s ring, 50 µs" in output
    assert "Σ‖p − C(p)‖²; relative" in output
    (event_file,) = board.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    missing = [t for t in TAGS if f"gradcomp/{t}" not in tags]
    assert not missing, missing
    assert "gradcomp/layer/net.0.weight/relative_error" in tags and "gradcomp/layer/net.4.bias/density" in tags
    totals = [e.value for e in events.Scalars("gradcomp/total_error")]
    assert len(totals) == 2 * 22 // 5 and totals[0] > 0
    assert all(b >= a for a, b in zip(totals, totals[1:])), "total error never decreases"
    ratio = [e.value for e in events.Scalars("gradcomp/compression_ratio")]
    assert min(ratio) > (20 if compressor == "topk" else 3)
    assert all(e.value > 0 for e in events.Scalars("gradcomp/comm_ms_est"))
    bound = 1 if compressor == "topk" else 2  # QSGD's error may exceed its input (variance up to √d/s)
    assert all(0 < e.value <= bound for e in events.Scalars("gradcomp/relative_error"))
    assert runs[0]["totals"]["error_sq"] > 0


def test_the_monitors_scalars_share_lightnings_step(tmp_path) -> None:
    """``gradcomp/*`` scalars are logged at the step Lightning logs the module's own metrics of the same
    batch (they were one step later: the step counter after the optimizer step; issue 36, item 9)."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gradcomp import GradCompSimStrategy
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=GradCompSimStrategy(workers=2, compressor="topk", print_summary=False),
                        callbacks=[CompressionMonitor(log_every_n_steps=2)], logger=CSVLogger(tmp_path, name="run"),
                        default_root_dir=tmp_path)
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(batch_size=64))
    with open(next(tmp_path.rglob("metrics.csv"))) as handle:
        rows = list(csv.DictReader(handle))
    ours = {int(row["step"]) for row in rows if row.get("gradcomp/bytes_sent")}
    lightnings = {int(row["step"]) for row in rows if row.get("train_loss")}
    assert ours and ours == lightnings, (ours, lightnings)
