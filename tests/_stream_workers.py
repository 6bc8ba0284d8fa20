"""Ranks of tests/test_streams_and_threads.py (real gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_gradcomp.exchange import thread as thread_module
from lightning_gradcomp.exchange.engine import Entry
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp import local_updates

from tests._local_workers import inner_optimizer, small_model
from tests._thread_workers import AllReduceInBackward


def check_overlapped_exchange_hands_over_its_tensors(rank: int, world_size: int) -> None:
    """An overlapped exchange (``exchange(..., overlap=True)``) hands every outer gradient and every output to the exchange thread (to be recorded
    on the exchange stream), and its future's value is the outputs (so that, on CUDA, waiting on it makes the
    waiter's stream wait for the exchange's writes)."""
    state = ExchangeSession("topk", exchange_thread=True, min_compress_numel=16)
    handed: list[torch.Tensor] = []
    submit = thread_module.ExchangeThread.submit

    def recording_submit(self, protocol, device, finish, handed_over=()):  # noqa: ANN001
        handed.extend(handed_over)
        return submit(self, protocol, device, finish, handed_over)

    thread_module.ExchangeThread.submit = recording_submit
    try:
        grads = [torch.randn(64), torch.randn(8)]
        outs = [torch.empty(64), torch.empty(8)]
        entries = [Entry(f"w{i}", tuple(g.shape), g, out) for i, (g, out) in enumerate(zip(grads, outs))]
        value = state.exchange(entries, last=True, overlap=True).wait()
    finally:
        thread_module.ExchangeThread.submit = submit
        state.close()
    identities = {id(tensor) for tensor in handed}
    assert all(id(tensor) in identities for tensor in grads + outs), "an input or output was not handed over"
    assert [id(tensor) for tensor in value] == [id(out) for out in outs], "the future must carry the outputs"


def check_thread_refused_on_nccl_with_one_hardware_queue(rank: int, world_size: int) -> None:
    """With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on NCCL (the backend faked here), ``exchange_thread=None`` runs
    in the hook and ``exchange_thread=True`` is refused, naming the variable."""
    import os

    real_get_backend = dist.get_backend
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    dist.get_backend = lambda group=None: "nccl"
    try:
        state = ExchangeSession("topk", exchange_thread=None, device=torch.device("cuda"))
        assert state.exchange_thread is False and state._thread_driver is None
        try:
            ExchangeSession("topk", exchange_thread=True)
        except ValueError as error:
            assert "CUDA_DEVICE_MAX_CONNECTIONS" in str(error) and "exchange_thread" in str(error), error
        else:
            raise AssertionError("exchange_thread=True with CUDA_DEVICE_MAX_CONNECTIONS=1 on NCCL was accepted")
    finally:
        dist.get_backend = real_get_backend
        del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]


class _SyncBatchNormLike(nn.Module):
    """The training group's collectives while the exchange thread runs: an all-reduce in backward (as
    SyncBatchNorm's) through :class:`AllReduceInBackward`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(AllReduceInBackward.apply(x.requires_grad_()))


def check_overlapped_local_updates_beside_training_collectives(rank: int, world_size: int) -> None:
    """Streaming DiLoCo with ``delay=2`` (exchanges on the exchange thread, on its own group, overlapping the
    next inner steps) while every inner step issues collectives on the training's group: one in backward
    (SyncBatchNorm-like) and a metric's all-reduce after the step (Lightning's ``sync_dist``). Each metric
    sum is exact (no message of one group paired with the other's), the job ends, and every rank holds the
    same ``θ_global``."""
    model = small_model()
    wrapped = _SyncBatchNormLike(model)
    optimizer = inner_optimizer(model)
    handle = local_updates(model, optimizer, sync_every=6, fragments=2, delay=2, alpha=0.5, compressor="int8",
                           min_compress_numel=256)
    for step in range(20):
        generator = torch.Generator().manual_seed(1009 * step + rank)
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        metric = torch.tensor([rank + 1.0, float(step)])
        dist.all_reduce(metric)
        assert metric.tolist() == [world_size * (world_size + 1) / 2, float(world_size * step)], (step, metric)
        handle.step()
    handle.loop.close()
    assert handle.loop.outer.syncs >= 5 and handle.totals.bytes_sent > 0
    flat = torch.cat([g.reshape(-1) for g in handle.loop.outer.global_params])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], other) for other in gathered)
