"""The end-of-training summary: what compression did over a whole run, in one short table.

Every way in (the Trainer strategies at the end of ``fit``, :class:`~lightning_gradcomp.lightning.fabric.GradCompFabricStrategy`
and :func:`~lightning_gradcomp.register` on request) prints the same table from the running
totals (:class:`~lightning_gradcomp.metrics.stats.StepStats`, averaged over ranks) and, when a network model is
given, the estimated communication time of the collectives actually issued next to that of DDP's dense
all-reduce of the same gradients.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats


def dense_time(totals: StepStats, network: Network, workers: int) -> float:
    """Seconds DDP's fp32 all-reduce of the same gradients would take: one all-reduce per bucket, the
    buckets of equal size (``bytes_dense / buckets``)."""
    if not totals.buckets:
        return 0.0
    return totals.buckets * network.all_reduce_time(totals.bytes_dense / totals.buckets, workers)


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def format_summary(compressor: str, workers: int, totals: StepStats, comm_s: Optional[float] = None,
                   dense_s: Optional[float] = None, network: Optional[Network] = None,
                   optimizer_steps: Optional[int] = None, dense_per_step: Optional[float] = None) -> str:
    """The summary table.

    Args:
        compressor: the compressor's description (its ``repr``).
        workers: workers that exchanged gradients.
        totals: running totals, averaged over workers (bytes per worker, as
            :func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent` counts them).
        comm_s / dense_s / network: the estimated communication time of the run and of dense DDP on
            ``network`` (rows left out when ``network`` is ``None``).
        optimizer_steps: under local updates, the optimizer steps the ``totals.steps`` synchronisations
            covered: the bytes are then also given per optimizer step and against DDP exchanging every
            step (fp32, and bf16 at half its bytes); the ratio is then against uncompressed DiLoCo.
        dense_per_step: under local updates, the bytes per worker of that every-step exchange (the whole
            model's: with fragments a synchronisation exchanges only one, so ``bytes_dense`` per
            synchronisation is not it); ``None``: ``bytes_dense`` per synchronisation.
    """
    steps = int(totals.steps)
    if optimizer_steps is None:
        rows = [
            ("compressor", compressor),
            ("workers, steps", f"{workers}, {steps}"),
            ("bytes sent / worker", f"{_bytes(totals.bytes_sent)} (dense DDP: {_bytes(totals.bytes_dense)})"),
            ("measured ratio", f"{totals.compression_ratio:.1f}x" if totals.bytes_sent else "n/a"),
        ]
    else:
        if dense_per_step is None:  # every synchronisation exchanged the whole model
            dense_per_step = totals.bytes_dense / steps if steps else 0.0
        per_step_ddp = dense_per_step * optimizer_steps  # fp32, every step
        against = (f"{per_step_ddp / totals.bytes_sent:.1f}x fewer than DDP fp32, "
                   f"{per_step_ddp / 2 / totals.bytes_sent:.1f}x fewer than DDP bf16") if totals.bytes_sent else "n/a"
        rows = [
            ("compressor", compressor),
            ("workers, syncs", f"{workers}, {steps} synchronisations in {optimizer_steps} optimizer steps"),
            ("bytes sent / worker", f"{_bytes(totals.bytes_sent)} (DDP fp32 exchanging every step: {_bytes(per_step_ddp)})"),
            ("per optimizer step", f"{_bytes(totals.bytes_sent / max(optimizer_steps, 1))}: {against}"),
            ("vs uncompressed DiLoCo", f"{totals.compression_ratio:.1f}x" if totals.bytes_sent else "n/a"),
        ]
    rows.append(("average density", f"{totals.density:.4g}" if totals.elements_total else "n/a"))
    if totals.grad_sq > 0:
        rows.append(("total compression error", f"{totals.error_sq:.4g} (Σ‖p − C(p)‖²; relative "
                                                f"{totals.relative_error:.3g})"))
    else:
        rows.append(("total compression error", "not recorded (telemetry off: add the Trainer's CompressionMonitor "
                     "callback, or telemetry=True in register(), local_updates() or the Fabric strategies)"))
    if network is not None and comm_s is not None and dense_s is not None:
        link = f"{network.bandwidth_gbps:g} Gbit/s {network.topology}, {network.latency_us:g} µs"
        saved = dense_s - comm_s
        rows.append(("est. communication", f"{comm_s:.3g} s vs {dense_s:.3g} s dense on {link}"))
        factor = ""
        if comm_s > 0 and dense_s > 0 and math.isfinite(dense_s):
            factor = f" ({dense_s / comm_s:.1f}x less)" if dense_s >= comm_s else f" ({comm_s / dense_s:.1f}x more)"
        rows.append(("est. time saved", f"{saved:.3g} s{factor}"))
    width = max(len(name) for name, _ in rows)
    lines = ["gradcomp summary"] + [f"  {name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join(lines)


def summarise(hook_state: Any, compressor: object, workers: int, network: Optional[Network] = None,
              mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda values: values,
              optimizer_steps: Optional[int] = None, dense_per_step: Optional[float] = None) -> str:
    """The summary of ``hook_state``'s running totals (``totals``, ``tally``), averaged over ranks by
    ``mean_over_ranks`` (a collective where ranks are processes: every rank must call it); ``compressor``
    is described by its ``repr``; ``optimizer_steps``, ``dense_per_step`` (this rank's): see
    :func:`format_summary`."""
    values = torch.tensor([*hook_state.totals.as_list(), dense_per_step or 0.0], dtype=torch.float64)
    *averaged, dense_per_step_mean = mean_over_ranks(values).tolist()
    totals = StepStats.from_list(averaged)
    dense_per_step = dense_per_step_mean if dense_per_step is not None else None
    comm_s = hook_state.tally.time(network, workers) if network is not None else None
    dense_s = dense_time(totals, network, workers) if network is not None else None
    if optimizer_steps is not None and network is not None:  # DDP would have exchanged every optimizer step
        if dense_per_step is not None and totals.bytes_dense > 0:  # the whole model every step, bucketed alike
            dense_s = dense_s * dense_per_step * optimizer_steps / totals.bytes_dense
        else:
            dense_s = dense_s / max(totals.steps, 1) * optimizer_steps
    return format_summary(repr(compressor), workers, totals, comm_s, dense_s, network, optimizer_steps, dense_per_step)
