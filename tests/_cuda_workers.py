"""Worker functions of the CUDA tests (tests/test_cuda.py), run in spawned processes on one GPU."""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import lightning_gradcomp
from lightning_gradcomp.compressors import COMPRESSORS, TopK
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook
from lightning_gradcomp.exchange.session import ExchangeSession

from tests._processes import free_port
from tests._sync_workers import fixed_size_variants


def _entry(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., None], args: tuple,
           gpu_per_rank: bool = False) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", rank if gpu_per_rank else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, **({"device_id": device} if gpu_per_rank else {}))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_gpu(fn: Callable[..., None], world_size: int, backend: str, *args: Any) -> None:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes sharing GPU 0 (NCCL: one process)."""
    mp.start_processes(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size,
                       start_method="spawn")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10)).cuda()


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches made on the GPU up front (a copy from pageable host memory synchronises)."""
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randn(32, 64, generator=generator).cuda(), torch.randint(0, 10, (32,), generator=generator).cuda())
            for _ in range(steps)]


def check_no_sync_in_the_hook(rank: int, world_size: int) -> None:
    """Every fixed-size compressor, thread on and off, telemetry on: steps under
    ``torch.cuda.set_sync_debug_mode("error")`` (warm-up steps first, outside it)."""
    for label, compressor in fixed_size_variants():
        for thread in (False, True):
            model = _model()
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.5)
            handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=256, exchange_thread=thread,
                                                 telemetry=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            batches = _batches(rank, 5)
            for step, (x, y) in enumerate(batches):
                if step == 2:  # after two warm-up steps (the first builds DDP's buckets)
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(ddp(x), y).backward()
                    optimizer.step()
                except RuntimeError as error:
                    torch.cuda.set_sync_debug_mode(0)
                    raise AssertionError(f"{label} thread={thread} step {step}: {error}") from error
            torch.cuda.set_sync_debug_mode(0)
            stats = handle.step_stats  # outside the hook: reads the measurements
            assert stats.bytes_sent > 0 and stats.grad_sq > 0, (label, stats)
            assert handle.hook_state.hook_calls >= 12, "several buckets per step"
            handle.close()


def check_flat_memory(rank: int, world_size: int, steps: int) -> None:
    """The raw hook (``GradCompHookState`` + ``gradcomp_hook``, nobody takes the figures), telemetry on,
    thread on and off: ``memory_allocated()`` flat from step 100 to ``steps``, and the per-step lists
    bounded."""
    for thread in (False, True):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.5)
        state = GradCompHookState(TopK(0.01), {id(p): n for n, p in model.named_parameters()}, min_compress_numel=256,
                                  exchange_thread=thread, device=torch.device("cuda"))
        state.telemetry = True
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = _batches(rank, 1)[0]
        allocated = {}
        for step in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            if step >= 100 and step % 50 == 0:
                torch.cuda.synchronize()
                allocated[step] = torch.cuda.memory_allocated()
        # What is alive at a sampled moment varies by up to about 0.5 MB here (blocks freed across streams
        # return late); a leak of one block (512 bytes) per step would raise the median of the second
        # half by about 0.5 MB over the first.
        first = statistics.median(value for step, value in allocated.items() if step < steps // 2)
        second = statistics.median(value for step, value in allocated.items() if step >= steps // 2)
        assert second <= first + 256 * 1024, (thread, first, second, allocated)
        clocks = (state.engine.compress_clock, state.engine.decompress_clock)
        assert all(len(clock._earlier.events) <= 256 for clock in clocks), "completed events are folded"
        assert len(state.driver._log) + len(state._thread_driver._log if state._thread_driver else []) <= 16
        assert len(state.pipeline.nonfinite._pending) <= 16
        assert len(state.pipeline.recorder._entries) <= 16
        assert state.totals.steps == steps - 1  # the last step is closed by the next read
        state.close()


def check_nccl_checkpoint_gathers_on_the_host(rank: int, world_size: int) -> None:
    """``state_dict()`` on NCCL gathers over a gloo group (nothing staged in GPU memory), ``rank_state_dict()``
    holds host copies, and a handle resumed from either continues exactly like the original."""
    batches = _batches(rank, 8)

    def make() -> tuple[nn.Module, Any, Any]:
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.5)
        handle = lightning_gradcomp.register(ddp, TopK(0.01), min_compress_numel=256)
        return model, ddp, handle

    def steps(model, ddp, optimizer, part) -> None:
        for x, y in part:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()

    model, ddp, handle = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps(model, ddp, optimizer, batches[:4])
    entry = handle.state_dict()
    assert dist.get_backend(handle.checkpoint_group) == "gloo"  # the gather runs on the host
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(t.device.type == "cpu" for r in entry["ranks"] for t in r["memory"]["residuals"].values())
    part = handle.rank_state_dict()  # this rank's part alone, no collective: host copies too
    assert all(t.device.type == "cpu" for t in part["ranks"][rank]["memory"]["residuals"].values())
    steps(model, ddp, optimizer, batches[4:])
    handle.close()

    for saved in (entry, part):  # the gathered entry, and each rank's own part
        resumed, resumed_ddp, resumed_handle = make()
        resumed.load_state_dict(saved_model)
        resumed_handle.load_state_dict(saved)
        assert all(r.device.type == "cuda" for r in resumed_handle.hook_state.memory.residuals.values())
        resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05)
        steps(resumed, resumed_ddp, resumed_optimizer, batches[4:])
        resumed_handle.close()
        for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
            assert torch.equal(a, b), name


def simulate(name: str, device: str, steps: int = 3, workers: int = 2) -> list[dict[str, torch.Tensor]]:
    """``steps`` steps of the ``workers``-worker simulation of ``name`` on ``device``; the aggregates on CPU."""
    from lightning_gradcomp.simulation import SimulatedExchange

    from tests._gloo_workers import conformance_settings

    shapes = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "big.weight": (256, 512), "fc.bias": (40,)}
    exchange = SimulatedExchange(COMPRESSORS[name](**conformance_settings().get(name, {})), workers,
                                 min_compress_numel=100)
    results = []
    for step in range(steps):
        for worker in range(workers):
            generator = torch.Generator().manual_seed(100 * step + worker)
            exchange.add_worker(worker, [(n, torch.randn(s, generator=generator).to(device)) for n, s in shapes.items()])
        results.append({n: t.cpu() for n, t in exchange.finish_step().items()})
    return results


# ---------------------------------------------------------------- issue 40: streams, threads, communicators
def check_overlapped_exchange_while_the_default_stream_allocates(rank: int, world_size: int) -> None:
    """Many 1 MB buckets of outer gradients exchanged on the exchange thread (``exchange(..., overlap=True)``) while the
    default stream allocates and overwrites memory of the same sizes (an inner step's new tensors): equal to
    the blocking ``exchange`` of the same inputs bit for bit. Without ``record_stream`` on the exchange stream the
    freed outer gradients' memory is handed to the default stream's next allocations while the exchange
    stream still reads it."""
    from lightning_gradcomp.exchange.engine import Entry

    def exchange(later: bool) -> list[torch.Tensor]:
        state = ExchangeSession("int8", exchange_thread=later, min_compress_numel=256, device=torch.device("cuda"))
        generator = torch.Generator(device="cuda").manual_seed(rank)
        outs, futures = [], []
        for number in range(48):
            grads = [torch.randn(2**18, device="cuda", generator=generator) for _ in range(2)]
            out = [torch.empty_like(grad) for grad in grads]
            entries = [Entry(f"b{number}.{i}", tuple(g.shape), g, o) for i, (g, o) in enumerate(zip(grads, out))]
            if later:
                futures.append(state.exchange(entries, last=True, overlap=True))
            else:
                state.exchange(entries, last=True)
            del grads, entries  # freed at once on this stream: reused by the scribbles below
            for _ in range(4):
                torch.full((2**18,), float("nan"), device="cuda").mul_(2)
            outs += out
        for future in futures:
            future.wait()
        state.close()
        return [out.cpu() for out in outs]

    now, later = exchange(False), exchange(True)
    assert all(torch.equal(a, b) for a, b in zip(now, later)), "overlapped outer gradients were overwritten"


def check_no_context_on_another_ranks_gpu(rank: int, world_size: int) -> None:
    """Two ranks on two GPUs (NCCL), the exchange thread on: no process holds a context on the other's GPU
    after a few steps (a new thread's device is 0)."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=0.5)
    handle = lightning_gradcomp.register(ddp, TopK(0.01), min_compress_numel=256, exchange_thread=True)
    _sgd_steps(ddp, rank, 5)
    handle.close()
    dist.barrier()
    pid = os.getpid()
    for device in range(world_size):
        listed = torch.cuda.list_gpu_processes(device)
        if device != rank:
            assert str(pid) not in listed, f"rank {rank} (pid {pid}) holds a context on GPU {device}:\n{listed}"


def run_one_gpu_per_rank(fn: Callable[..., None], world_size: int) -> None:
    """``fn(rank, world_size)`` in ``world_size`` NCCL processes, rank ``r`` on GPU ``r``."""
    mp.start_processes(_entry, args=(world_size, free_port(), "nccl", fn, (), True), nprocs=world_size,
                       start_method="spawn")


def _sgd_steps(ddp: nn.Module, rank: int, steps: int) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x, y in _batches(rank, steps):
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()


def check_one_hardware_queue(rank: int, world_size: int) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` (set before CUDA starts) on NCCL: the exchange runs in the hook,
    200 steps of Top-k and PowerSGD finish, and ``exchange_thread=True`` is refused."""
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    for compressor in (TopK(0.01), COMPRESSORS["powersgd"]()):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.5)
        handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=256)
        assert handle.hook_state.thread is None and handle.hook_state.exchange_thread is False
        _sgd_steps(ddp, rank, 200)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    try:
        GradCompHookState("topk", {}, exchange_thread=True)
    except ValueError as error:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in str(error)
    else:
        raise AssertionError("exchange_thread=True accepted with CUDA_DEVICE_MAX_CONNECTIONS=1 on NCCL")


def check_compressed_hsdp_without_host_sync(rank: int, world_size: int) -> None:
    """``register_fsdp`` on NCCL (a 1 x 1 mesh), every fixed-size compressor, fp32 and a bf16
    ``MixedPrecisionPolicy`` (the hook's shard freed after it: ``record_stream``): steps under
    ``torch.cuda.set_sync_debug_mode("error")`` after two warm-up steps, finite parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for label, compressor in fixed_size_variants():
        for policy in (MixedPrecisionPolicy(), bf16):
            model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["shard"], mp_policy=policy)
            fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
            handle = lightning_gradcomp.register_fsdp(model, mesh, compressor, min_compress_numel=256)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            handle.bind(optimizer)
            for step, (x, y) in enumerate(_batches(rank, 5)):
                if step == 2:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                except RuntimeError as error:
                    torch.cuda.set_sync_debug_mode(0)
                    raise AssertionError(f"{label} {policy.param_dtype} step {step}: {error}") from error
            torch.cuda.set_sync_debug_mode(0)
            assert handle.hook_state.step == 5 and handle.step_stats.bytes_sent >= 0, label
            assert all(torch.isfinite(p.to_local()).all() for p in model.parameters()), label
            handle.close()


def check_sharded_local_updates_on_nccl(rank: int, world_size: int) -> None:
    """Local updates on FSDP2 shards on NCCL (a 1 x 1 mesh), θ_global on the GPU and in pinned host memory
    (``global_device="cpu"``), int8 and SparseLoCo, H = 3 over 7 steps with a bf16 ``MixedPrecisionPolicy``:
    both places end within 1e-5 (the outer step's arithmetic, on two devices), every parameter finite,
    and the host copy of θ_global is pinned; ``global_weights()`` shows it and gives the replica back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for compressor in ("int8", "sparseloco"):
        ends = {}
        for place in (None, "cpu"):
            model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["shard"], mp_policy=policy)
            fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            handle = lightning_gradcomp.local_updates(model, optimizer, 3, compressor, mesh=mesh,
                                                      min_compress_numel=256, global_device=place)
            glob = handle.loop.outer.global_params[0]
            assert glob.device.type == ("cpu" if place else "cuda") and (place is None or glob.is_pinned())
            for x, y in _batches(rank, 7):
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            replica = [p.to_local().clone() for p in model.parameters()]
            with handle.global_weights():
                shown = [p.to_local().clone() for p in model.parameters()]
            assert all(torch.equal(p.to_local(), r) for p, r in zip(model.parameters(), replica))
            assert all(torch.equal(s.cpu(), g.cpu()) for s, g in zip(shown, handle.loop.outer.global_params))
            handle.sync()
            ends[place] = [p.to_local().clone() for p in model.parameters()]
            assert all(torch.isfinite(p).all() for p in ends[place]), compressor
            handle.close()
        for on_gpu, on_host in zip(ends[None], ends["cpu"]):  # the outer step on the CPU may round otherwise
            torch.testing.assert_close(on_host, on_gpu, atol=1e-5, rtol=0)
