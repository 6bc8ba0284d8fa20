"""Worker functions for the host-synchronisation checks in real gloo processes (see tests/_host_sync.py)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

import lightning_gradcomp
from lightning_gradcomp.compressors import COMPRESSORS, Compressor
from lightning_gradcomp.core.device import accelerator_path

from tests._gloo_workers import conformance_settings
from tests._host_sync import checking_the_exchange
from tests._training import sgd_steps

#: Compressors whose payload size does not depend on the data: no host read is allowed for them.
FIXED_SIZE = sorted(name for name, cls in COMPRESSORS.items() if cls().static_count(4096) is not None)


#: Stochastic quantisers draw their noise with ``uniform_`` along the accelerator path (as on a GPU) and
#: from 16-bit lanes on the CPU path: their reference is the accelerator path, run without the checks.
STOCHASTIC = ("qsgd", "terngrad")


def reference_path(label: str):
    """What the checked run is compared with: the CPU path, or for :data:`STOCHASTIC` compressors the
    same accelerator path without the host-read checks."""
    return accelerator_path() if label in STOCHASTIC else nullcontext()


def fixed_size_variants() -> list[tuple[str, Compressor]]:
    """Every fixed-size compressor (conformance settings), and Top-k and DGC with the sampled selection."""
    variants = [(name, COMPRESSORS[name](**conformance_settings().get(name, {}))) for name in FIXED_SIZE]
    variants += [("topk-sampled", COMPRESSORS["topk"](density=0.05, selection="sampled")),
                 ("dgc-sampled", COMPRESSORS["dgc"](density=0.05, selection="sampled"))]
    return variants


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 2.2 MB of weights: DDP's first bucket holds up to 1 MiB whatever bucket_cap_mb says
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def _train(rank: int, compressor: Compressor, thread: bool, steps: int = 3) -> torch.Tensor:
    """``steps`` steps of a DDP model of several buckets with the compressed exchange and telemetry on;
    the parameters afterwards."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
    handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=256, exchange_thread=thread,
                                         telemetry=True)
    params = sgd_steps(ddp, rank, steps, inputs=64, lr=0.1)
    handle.close()
    assert handle.hook_state.hook_calls >= 2 * steps, "several buckets per step"
    return params


def check_no_host_reads_in_the_hook(rank: int, world_size: int) -> None:
    """Every fixed-size compressor, exchange thread on and off, along the accelerator path: no host read
    in the hook or in any step of a bucket's exchange, and the same parameters as the CPU path."""
    for label, compressor in fixed_size_variants():
        for thread in (False, True):
            with checking_the_exchange():
                accelerated = _train(rank, compressor, thread)
            with reference_path(label):
                reference = _train(rank, compressor, thread)
            torch.testing.assert_close(accelerated, reference, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{label} thread={thread}: {m}")
            gathered = [torch.empty_like(accelerated) for _ in range(world_size)]
            dist.all_gather(gathered, accelerated)
            assert all(torch.equal(gathered[0], other) for other in gathered), (label, thread)
