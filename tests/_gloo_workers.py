"""Worker functions for tests that run in real gloo process groups (imported by spawned processes)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gradcomp.compressors import BF16, DGC, FP16, QSGD, CompressContext, HardThreshold, NoCompression, RandomK, TopK
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook
from lightning_gradcomp.exchange.state import ExchangeState


class ListBucket:
    """A bucket of gradients laid out like DDP's ``GradBucket``: views into one flat buffer."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], last: bool = True) -> None:
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views = list(self._buffer.split([g.numel() for g in grads]))
        self._views = [v.view(g.shape) for v, g in zip(self._views, grads)]
        self._params, self._last = params, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def index(self) -> int:
        return 0


class CollectiveSpy:
    """Wraps torch.distributed's collectives and records the bytes each sends from this rank, counted here
    from the tensors handed to them: every input tensor's bytes, less an all-to-all's own row (row ``r`` of
    rank ``r``'s input never leaves the process). ``calls``: ``(collective, dtype, input elements)``."""

    NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all_single")

    def __init__(self) -> None:
        self.bytes = 0
        self.calls: list[tuple[str, torch.dtype, int]] = []
        self._originals = {}

    def __enter__(self) -> "CollectiveSpy":
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                tensor = args[0] if _name == "all_reduce" else args[1]
                tensors = tensor if isinstance(tensor, list) else [tensor]
                for t in tensors:
                    nbytes = t.numel() * t.element_size()
                    if _name == "all_to_all_single":
                        nbytes -= nbytes // dist.get_world_size(kwargs.get("group"))
                    self.bytes += nbytes
                    self.calls.append((_name, t.dtype, t.numel()))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _local_grads(rank: int, shapes: list[tuple[int, ...]], step: int, scale_by_rank: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    scale = (1.0 if rank == 0 else 1e-3) if scale_by_rank else 1.0
    return [torch.randn(shape, generator=generator) * scale for shape in shapes]


def _exchange(state: GradCompHookState, params, grads) -> torch.Tensor:
    bucket = ListBucket(params, grads)
    return gradcomp_hook(state, bucket).wait().clone()


def check_counted_bytes_and_averages(rank: int, world_size: int) -> None:
    """For each compressor: the bytes the hook reports equal the bytes handed to the collectives, and
    the result equals the average over workers of each worker's decompressed payload."""
    shapes = [(100, 200), (300,), (50, 40)]  # the 300-element bias goes dense
    params = [torch.empty(s) for s in shapes]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    cases = [
        (TopK(0.01), False, 0.0),
        (RandomK(0.02), False, 0.0),
        (RandomK(0.02, shared_indices=False), False, 0.0),
        (HardThreshold(2.5), True, 0.0),
        (QSGD(levels=8, bucket_size=128), False, 1e-6),
        (NoCompression(), False, 0.0),
        (FP16(), False, 2e-3),
        (BF16(), False, 2e-2),
        (DGC(density=0.01, momentum=0.9), False, 1e-6),
    ]
    for compressor, uneven, tolerance in cases:
        state = GradCompHookState(compressor, names, error_feedback=False, min_compress_numel=1024)
        assert isinstance(state, ExchangeState), "the hook state offers the declared contract"
        grads = _local_grads(rank, shapes, step=0, scale_by_rank=uneven)
        with CollectiveSpy() as spy:
            result = _exchange(state, params, grads)
        stats = state.take_step_stats()
        assert stats.bytes_sent == spy.bytes == state.driver.bytes_sent, (compressor, stats, spy.calls)
        assert stats.bytes_dense == sum(g.numel() for g in grads) * 4
        if not isinstance(compressor, NoCompression):
            assert stats.bytes_sent < stats.bytes_dense, (compressor, stats)

        expected = []
        for g_index, shape in enumerate(shapes):
            total = torch.zeros(torch.Size(shape).numel())
            for r in range(world_size):
                g = _local_grads(r, shapes, step=0, scale_by_rank=uneven)[g_index].reshape(-1)
                if g.numel() < 1024:
                    total += g / world_size
                    continue
                ctx = CompressContext(f"p{g_index}", 0, r, world_size, 0)
                total += compressor.decompress(compressor.compress(g, ctx)) / world_size
            expected.append(total)
        torch.testing.assert_close(result, torch.cat(expected), rtol=tolerance, atol=tolerance)
        if isinstance(compressor, HardThreshold):
            assert any(c[1] == torch.int32 and c[2] == 2 for c in spy.calls), "counts were exchanged"


def check_topk_ratio_is_fifty(rank: int, world_size: int) -> None:
    """Top-k at density 0.01, fp32 values and int32 indices: 8 bytes per kept element, a 50x ratio."""
    param = torch.empty(1000, 400)
    state = GradCompHookState(TopK(0.01), {id(param): "w"}, min_compress_numel=1024)
    with CollectiveSpy() as spy:
        _exchange(state, [param], _local_grads(rank, [(1000, 400)], step=0))
    stats = state.take_step_stats()
    assert spy.bytes == stats.bytes_sent == 4000 * 8 + 8  # + the bucket's finiteness flag, aligned to 8
    assert stats.compression_ratio == pytest.approx(50.0, rel=1e-3)
    assert stats.density == 0.01


def check_multibucket_ddp_stays_in_sync(rank: int, world_size: int) -> None:
    """A real DDP model split in several buckets, with data-dependent payload sizes (hard threshold)
    and error feedback: every rank ends with identical parameters, and the hook ran on every bucket."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512),
                          nn.Tanh(), nn.Linear(512, 4))
    # The first bucket holds up to 1 MiB whatever bucket_cap_mb says; 2 MiB of weights make 3+ buckets.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    state = GradCompHookState(HardThreshold(0.002), names, min_compress_numel=64)
    ddp.register_comm_hook(state, gradcomp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        optimizer.zero_grad()
        x = torch.randn(16, 32, generator=generator)
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    assert state.step == 6
    assert state.hook_calls > 6 * 2, f"several buckets per step, got {state.hook_calls}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)
    assert state.memory.residuals, "error feedback kept residuals"


def check_telemetry_totals(rank: int, world_size: int) -> None:
    """``totals.error_sq`` equals the sum over steps of ``‖e_{t+1}‖²`` read from the memory itself (error
    feedback), of ``‖p − D(C(p))‖²`` recomputed (no error feedback), or of ``‖v_{t+1}‖²`` (DGC); bytes and
    density totals equal the transport's counts."""
    from lightning_gradcomp.compressors import DGC
    from lightning_gradcomp.compressors.dgc import VELOCITY

    shapes = [(64, 100), (50,)]
    params = [torch.empty(s) for s in shapes]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    for compressor in (TopK(0.05), QSGD(levels=4), DGC(density=0.05, momentum=0.9)):
        state = GradCompHookState(compressor, names, min_compress_numel=100)
        state.telemetry = True
        expected_error, expected_sent, expected_total = 0.0, 0, 0
        for step in range(4):
            grads = _local_grads(rank, shapes, step=step)
            if isinstance(compressor, QSGD):  # recompute the compression error independently
                ctx = CompressContext("p0", step, rank, world_size, 0)
                x = grads[0].reshape(-1)
                expected_error += float((x - compressor.decompress(compressor.compress(x, ctx))).double().pow(2).sum())
            _exchange(state, params, grads)
            stats = state.take_step_stats()
            if isinstance(compressor, TopK):
                expected_error += float(state.memory.residuals["p0"].double().pow(2).sum())
            elif isinstance(compressor, DGC):
                expected_error += float(state.memory.states["p0"][VELOCITY].double().pow(2).sum())
            expected_sent += round(0.05 * 6400) + 50 if not isinstance(compressor, QSGD) else 6450
            expected_total += 6450
            assert stats.compress_s > 0 and stats.decompress_s > 0
            assert stats.grad_sq > 0 and stats.error_sq > 0
            if not isinstance(compressor, QSGD):  # a sparsifier's error is part of its input
                assert stats.error_sq < stats.grad_sq
        totals = state.totals
        assert totals.steps == 4
        assert abs(totals.error_sq - expected_error) <= 1e-6 * expected_error, (compressor, totals.error_sq, expected_error)
        assert totals.bytes_sent == state.driver.bytes_sent
        assert (totals.elements_sent, totals.elements_total) == (expected_sent, expected_total)
        assert totals.density == expected_sent / expected_total


def conformance_settings() -> dict[str, dict]:
    """Constructor arguments of the conformance suite per registered name (others: the defaults)."""
    return {"topk": {"density": 0.05}, "randomk": {"density": 0.05}, "dgc": {"density": 0.05},
            "threshold": {"threshold": 0.02}, "powersgd": {"rank": 2},
            "signsgd": {"momentum": 0.9}}  # Signum: the variant with compressor state


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def _batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7919 * step + worker)
    return torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def check_real_equals_simulated(rank: int, world_size: int, names: list[str], device: str = "cpu",
                                tolerance: float = 1e-5) -> None:
    """Per compressor, exchanged in the hook and on the exchange thread: 3 steps of a real DDP model with
    the gradcomp hook, and the same 3 steps with the simulated exchange of ``world_size`` workers:
    parameters within ``tolerance``, bytes exactly equal, and the bytes counted equal the bytes handed
    to torch.distributed. ``device="cuda"``: model, gradients and simulation on the GPU (several ranks
    may share it on gloo)."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.compressors import COMPRESSORS
    from lightning_gradcomp.simulation import SimulatedExchange

    settings = conformance_settings()
    loss_fn = nn.CrossEntropyLoss()
    for name, thread in [(name, thread) for name in names for thread in (False, True)]:
        make = lambda: COMPRESSORS[name](**settings.get(name, {}))  # noqa: E731
        model = _small_model().to(device)
        ddp = DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
        state = GradCompHookState(make(), {id(p): n for n, p in model.named_parameters()}, min_compress_numel=256,
                                  exchange_thread=thread, device=torch.device(device))
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        real_bytes = []
        for step in range(3):
            x, y = (t.to(device) for t in _batch(step, rank))
            with CollectiveSpy() as spy:
                loss_fn(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = state.take_step_stats()
            assert stats.bytes_sent == spy.bytes, (name, stats.bytes_sent, spy.calls)
            real_bytes.append(stats.bytes_sent)
        state.close()

        twin = _small_model().to(device)
        exchange = SimulatedExchange(make(), world_size, min_compress_numel=256)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
        simulated_bytes = []
        for step in range(3):
            for worker in range(world_size):
                for p in twin.parameters():
                    p.grad = None
                x, y = (t.to(device) for t in _batch(step, worker))
                loss_fn(twin(x), y).backward()
                exchange.add_worker(worker, [(n, p.grad) for n, p in twin.named_parameters()])
            aggregate = exchange.finish_step()
            for n, p in twin.named_parameters():
                p.grad = aggregate[n].view_as(p)
            twin_optimizer.step()
            simulated_bytes.append(exchange.step_stats.bytes_sent)
        assert simulated_bytes == real_bytes, (name, simulated_bytes, real_bytes)
        for (n, real), (_, simulated) in zip(model.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(simulated, real, rtol=tolerance, atol=tolerance,
                                       msg=lambda m: f"{name} thread={thread} {n}: {m}")


def check_nonfinite_propagates(rank: int, world_size: int, names: list[str]) -> None:
    """A NaN in rank 1's gradient: the bucket is NaN on both ranks, only rank 1 warns, and both ranks'
    residuals are unchanged."""
    import warnings

    from lightning_gradcomp.compressors import COMPRESSORS

    shapes = [(64, 48), (300,)]
    params = [torch.empty(s) for s in shapes]
    names_by_id = {id(p): f"p{i}" for i, p in enumerate(params)}
    for name in names:
        state = GradCompHookState(COMPRESSORS[name](**conformance_settings().get(name, {})), names_by_id,
                                  min_compress_numel=1024)
        _exchange(state, params, _local_grads(rank, shapes, step=0))
        state.take_step_stats()
        before = {k: v.clone() for k, v in state.memory.residuals.items()}
        grads = _local_grads(rank, shapes, step=1)
        if rank == 1:
            grads[0][2, 3] = float("nan")
        result = _exchange(state, params, grads)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.take_step_stats()
        warned = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        assert torch.isnan(result).all(), (name, rank)
        assert (len(warned) == 1 and "rank 1 at step 2 in p0" in warned[0]) if rank == 1 else not warned, warned
        for key, value in before.items():
            assert torch.equal(state.memory.residuals[key], value), (name, key, rank)
        state.close()


def train_digits_with_each(rank: int, world_size: int, names: list[str], out: str, epochs: int = 10,
                           settings: Optional[dict[str, tuple[str, dict, Optional[bool]]]] = None) -> None:
    """Plain DDP and the gradcomp hook with each compressor train the quick-start digits MLP (SGD, lr 0.1,
    batch 32 per process, ``epochs`` epochs, the same initial weights and data order); rank 0 writes
    every run's test accuracy to ``out``. A name is a registered compressor with default arguments, or a
    label in ``settings`` mapping to ``(registered name, constructor arguments, error_feedback)``."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_gradcomp.compressors import COMPRESSORS
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    data = DigitsDataModule()
    data.setup("fit")
    accuracies = {}
    for name in ["ddp", *names]:
        torch.manual_seed(0)
        model = DigitsClassifier()
        ddp = DistributedDataParallel(model)
        state = None
        if name != "ddp":
            registered, kwargs, error_feedback = (settings or {}).get(name, (name, {}, None))
            state = GradCompHookState(COMPRESSORS[registered](**kwargs), {id(p): n for n, p in model.named_parameters()},
                                      error_feedback=error_feedback)
            ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = DistributedSampler(data.train_set, world_size, rank, shuffle=True, seed=0)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(data.train_set, batch_size=32, sampler=sampler):
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
        if state is not None:
            state.close()
        with torch.no_grad():
            x, y = next(iter(DataLoader(data.test_set, batch_size=len(data.test_set))))
            accuracies[name] = float((model(x).argmax(1) == y).float().mean())
    if rank == 0:
        torch.save(accuracies, out)


def check_hierarchical_equals_simulated(rank: int, world_size: int, names: list[str]) -> None:
    """2 nodes x 2 processes: per compressor, 3 steps of a real DDP model with the hierarchical hook and
    the same steps with the simulated hierarchical exchange (each node's average fed to 2 simulated
    nodes): parameters within 1e-5; only cross-node bytes are counted as sent, the intra-node
    all-reduces are logged. ``"none"`` also matches plain DDP (no hook)."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.compressors import COMPRESSORS
    from lightning_gradcomp.ddp.hierarchy import HierarchicalHookState, local_average, node_groups
    from lightning_gradcomp.simulation import SimulatedExchange

    nodes, local_size = 2, world_size // 2
    intra, cross = node_groups(nodes, local_size)
    settings = conformance_settings()
    loss_fn = nn.CrossEntropyLoss()

    def train_real(state) -> nn.Module:
        model = _small_model()
        ddp = DistributedDataParallel(model)
        if state is not None:
            state.param_names = {id(p): n for n, p in model.named_parameters()}
            ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = _batch(step, rank)
            with CollectiveSpy() as spy:
                loss_fn(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if state is not None:
                stats = state.take_step_stats()
                kinds = {kind.split(":")[0] for kind, _ in stats.collectives}
                assert kinds <= {"node", "cross"}, stats.collectives
                intra_bytes = sum(n for kind, n in stats.collectives if kind.startswith("node:"))
                assert stats.bytes_sent + intra_bytes == spy.bytes, (stats.collectives, spy.calls)
                assert intra_bytes == 2 * stats.bytes_dense  # two dense all-reduces inside the node
        return model

    plain = train_real(None)
    for name in names:
        make = lambda: COMPRESSORS[name](**settings.get(name, {}))  # noqa: E731
        state = HierarchicalHookState(make(), {}, intra_group=intra, cross_group=cross, min_compress_numel=256)
        assert state.layout == "nodes=2,local=2"
        model = train_real(state)
        state.close()

        twin = _small_model()
        exchange = SimulatedExchange(make(), nodes, min_compress_numel=256, local_size=local_size)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
        for step in range(3):
            for node in range(nodes):
                node_grads = []
                for local in range(local_size):
                    for p in twin.parameters():
                        p.grad = None
                    x, y = _batch(step, node * local_size + local)
                    loss_fn(twin(x), y).backward()
                    node_grads.append([(n, p.grad) for n, p in twin.named_parameters()])
                exchange.add_worker(node, local_average(node_grads))
            aggregate = exchange.finish_step()
            for n, p in twin.named_parameters():
                p.grad = aggregate[n].view_as(p)
            twin_optimizer.step()
        for (n, real), (_, simulated) in zip(model.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(simulated, real, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
        if name == "none":
            for (n, real), (_, flat) in zip(model.named_parameters(), plain.named_parameters()):
                torch.testing.assert_close(real, flat, rtol=1e-6, atol=1e-6, msg=lambda m: f"none vs DDP {n}: {m}")
