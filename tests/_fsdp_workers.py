"""Ranks of the compressed-HSDP tests (tests/test_fsdp.py): FSDP2 on gloo, 2 replicas x 2 shards."""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_gradcomp
from lightning_gradcomp.core.fsdp2 import param_groups

STEPS = 3


class Net(nn.Module):
    """Blocks of different shapes: rows not divisible by the shard count (padding), a small bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(24, 48)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48)) for _ in range(2)])
        self.head = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor, blocks: int = 2) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks[:blocks]:
            x = x + block(x)
        return self.head(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _shard(model: nn.Module, mesh, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 24, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def _train(model: nn.Module, rank: int, steps: int = STEPS, first: int = 0, accumulate: int = 1) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first, first + steps):
        for micro in range(accumulate):
            if accumulate > 1:
                model.set_requires_gradient_sync(micro == accumulate - 1)
            x, y = _batch(step * accumulate + micro, rank)
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (an all-gather of the shards), on every rank."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _assert_none_equals_native_hsdp(mesh, rank: int) -> None:
    """``STEPS`` steps of ``register_fsdp(..., "none")`` on ``mesh["shard"]`` end bit for bit where native
    HSDP (``fully_shard`` on the 2-D mesh) does."""
    native = _shard(_model(), mesh)
    _train(native, rank)
    ours = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(ours, mesh, "none")
    _train(ours, rank)
    expected, got = _full(native), _full(ours)
    for name in expected:
        assert torch.equal(got[name], expected[name]), (name, (got[name] - expected[name]).abs().max())
    assert handle.hook_state.step == STEPS and handle.hook_state.hook_calls == 3 * STEPS
    handle.close()


def check_none_equals_native_hsdp(rank: int, world_size: int) -> None:
    _assert_none_equals_native_hsdp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), rank)


def _recording(hook, layout, seen: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """``hook`` that also keeps each parameter's shard before and after the exchange."""
    def recorded(reduce_output: torch.Tensor) -> None:
        before = reduce_output.detach().clone()
        hook(reduce_output)
        for slot in layout.slots:
            if slot.numel:
                part = slice(slot.offset, slot.offset + slot.numel)
                seen[slot.name] = (before[part].clone(), reduce_output.detach()[part].clone())
    return recorded


def check_every_compressor_against_the_oracle(rank: int, world_size: int) -> None:
    """For every registered compressor, two steps on 2 replicas x 2 shards: each shard's exchange equals the
    engine's in-process exchange (:class:`SimulatedExchange`) of the two replicas' same shards, bit for bit,
    so the replicas decode the same values; padding is never sent."""
    from lightning_gradcomp.compressors import COMPRESSORS, get_compressor
    from lightning_gradcomp.exchange.simulated import SimulatedExchange

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()
    for name in COMPRESSORS:
        model = _shard(_model(), mesh["shard"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = lightning_gradcomp.register_fsdp(model, mesh, name, min_compress_numel=64)
        handle.bind(optimizer)
        oracle_compressor = get_compressor(name)
        oracle_compressor.check_optimizer(optimizer)
        oracle = SimulatedExchange(oracle_compressor, 2, min_compress_numel=64)
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        modules = dict(model.named_modules())
        for layout in handle.layouts:
            group = param_groups(modules[layout.module])[0]
            modules[layout.module].set_all_reduce_hook(_recording(handle.all_reduce_hook(layout, group), layout, seen))
        shapes = {slot.name: slot.shape for layout in handle.layouts for slot in layout.slots}
        for step in range(2):
            seen.clear()
            x, y = _batch(step, rank)
            nn.functional.cross_entropy(model(x), y).backward()
            inputs = [None, None]
            dist.all_gather_object(inputs, {key: before for key, (before, _) in seen.items()}, group=replicate)
            for worker, grads in enumerate(inputs):
                oracle.add_worker(worker, list(grads.items()), shapes)
            expected = oracle.finish_step()
            for key, (_, after) in seen.items():
                assert torch.equal(after, expected[key].view_as(after)), (name, step, key)
            optimizer.step()
            optimizer.zero_grad()
        assert handle.hook_state.step == 2, name
        handle.close()


def check_bytes_accumulation_bf16_and_resume(rank: int, world_size: int) -> None:
    """Top-k 1% on a wider model: at least 30x fewer bytes than native HSDP's fp32 all-reduce, counted at
    the collective; gradient accumulation exchanges once per optimizer step; a bf16 MixedPrecisionPolicy
    keeps fp32 residuals; a resume from ``state_dict()`` continues bit for bit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_gradcomp.compressors import TopK

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(24, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 5))
    for layer in (wide[0], wide[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(wide, mesh=mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(wide, mesh, TopK(0.01))
    optimizer = torch.optim.SGD(wide.parameters(), lr=0.1)
    x, y = _batch(0, rank)
    nn.functional.cross_entropy(wide(x), y).backward()
    optimizer.step()
    stats = handle.step_stats
    assert stats.bytes_dense / stats.bytes_sent >= 30, stats
    handle.close()

    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    _train(model, rank, steps=2, accumulate=3)
    assert handle.hook_state.step == 2 and handle.hook_state.hook_calls == 2 * 3, "one exchange per optimizer step"
    handle.close()

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = _shard(_model(), mesh["shard"], mp_policy=policy)
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    _train(model, rank, steps=2)
    residuals = handle.hook_state.memory.residuals
    assert residuals and all(r.dtype == torch.float32 for r in residuals.values())
    handle.close()

    whole = _shard(_model(), mesh["shard"])
    whole_handle = lightning_gradcomp.register_fsdp(whole, mesh, "topk")
    _train(whole, rank, steps=4)
    first = _shard(_model(), mesh["shard"])
    first_handle = lightning_gradcomp.register_fsdp(first, mesh, "topk")
    _train(first, rank, steps=2)
    entry = [first_handle.state_dict()]
    dist.broadcast_object_list(entry, src=0)
    shards = {name: p.to_local().detach().clone() for name, p in first.named_parameters()}
    resumed = _shard(_model(), mesh["shard"])
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.to_local().copy_(shards[name])
    resumed_handle = lightning_gradcomp.register_fsdp(resumed, mesh, "topk")
    resumed_handle.load_state_dict(entry[0])
    _train(resumed, rank, steps=2, first=2)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    assert whole_handle.totals.bytes_sent == resumed_handle.totals.bytes_sent
    for handle in (whole_handle, first_handle, resumed_handle):
        handle.close()


def check_bad_meshes_and_modules_are_refused(rank: int, world_size: int) -> None:
    import pytest

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="must be 2-D with mesh_dim_names"):
        lightning_gradcomp.register_fsdp(_shard(_model(), mesh["shard"]), mesh["shard"], "topk")
    with pytest.raises(ValueError, match="native HSDP"):
        lightning_gradcomp.register_fsdp(_shard(_model(), mesh), mesh, "topk")
    with pytest.raises(ValueError, match="found no module sharded with FSDP2"):
        lightning_gradcomp.register_fsdp(_model(), mesh, "topk")
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    with pytest.raises(ValueError, match="sharded over other ranks than mesh\\['shard'\\]"):
        lightning_gradcomp.register_fsdp(_shard(_model(), other["shard"]), mesh, "topk")
    # several parameter groups in one module (fully_shard with a shard_placement_fn over several meshes): FSDP2
    # builds them only on meshes this test cannot make, so the groups of a real module are listed twice
    from lightning_gradcomp.core import fsdp2
    from lightning_gradcomp.fsdp import handle as fsdp_handle

    real_groups = fsdp2.param_groups
    fsdp2.param_groups = lambda module: real_groups(module) * 2
    try:
        with pytest.raises(ValueError, match="has 2 parameter groups"):
            lightning_gradcomp.register_fsdp(_shard(_model(), mesh["shard"]), mesh, "topk")
    finally:
        fsdp2.param_groups = real_groups
    # compiled autograd: the hook's guard, with torch's flag as compiled autograd sets it while it runs
    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    real_flag = fsdp_handle._compiled_autograd_active
    fsdp_handle._compiled_autograd_active = lambda: True
    try:
        with pytest.raises(RuntimeError, match="does not run under compiled autograd"):
            fsdp_handle._check_reduce_settings("", None)
    finally:
        fsdp_handle._compiled_autograd_active = real_flag
    handle.close()


def check_a_non_finite_shard(rank: int, world_size: int) -> None:
    """Replica 0's batch holds an inf: its shards are NaN after FSDP's reduce-scatter. The compressed
    exchange makes every replica's shards NaN (never finite-looking damage), the ranks whose shard was not
    finite warn, and the residuals stay as they were."""
    import warnings

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk", min_compress_numel=64)
    _train(model, rank, steps=1)
    residuals = {name: r.clone() for name, r in handle.hook_state.memory.residuals.items()}
    x, y = _batch(1, rank)
    if rank in (0, 1):  # replica 0
        x[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nn.functional.cross_entropy(model(x), y).backward()
        handle.step_stats  # closes the step: the warnings that reached the host
    for name, p in model.named_parameters():
        assert torch.isnan(p.grad.to_local()).all(), name
    for name, residual in handle.hook_state.memory.residuals.items():
        assert torch.equal(residual, residuals[name]), f"the residual of {name} is unchanged"
    if rank in (0, 1):  # the ranks whose own shard was not finite say so
        assert any("not finite" in str(w.message) or "non-finite" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
    handle.close()


def check_refusals_and_a_non_finite_shard(rank: int, world_size: int) -> None:
    check_bad_meshes_and_modules_are_refused(rank, world_size)
    check_a_non_finite_shard(rank, world_size)


def check_no_host_reads_in_the_fsdp_hook(rank: int, world_size: int) -> None:
    """Every fixed-size compressor along the accelerator path (CPU tensors take it): no host read in the
    FSDP hook's exchange, the replicas agree, the parameters stay finite."""
    from tests._host_sync import checking_the_exchange
    from tests._sync_workers import fixed_size_variants

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for label, compressor in fixed_size_variants():
        model = _shard(_model(), mesh["shard"])
        handle = lightning_gradcomp.register_fsdp(model, mesh, compressor, min_compress_numel=64)
        with checking_the_exchange():
            _train(model, rank, steps=2)
        local = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
        assert torch.isfinite(local).all(), label
        gathered = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(gathered, local, group=mesh["replicate"].get_group())
        assert torch.equal(gathered[0], gathered[1]), label
        handle.close()


def check_steps_settings_and_mesh_changes(rank: int, world_size: int) -> None:
    """A step ends with its backward whichever groups it reduced (a block unused in the first step, then
    used); unsharded trainable parameters, a gradient divide factor and set_requires_all_reduce(False) are
    refused; a resume on another replicate x shard split drops the residuals, saying so."""
    import pytest

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step, rank)
        nn.functional.cross_entropy(model(x, blocks=2 if step else 1), y).backward()  # block 1 sits out step 0
        optimizer.step()
        optimizer.zero_grad()
        assert handle.hook_state.step == step + 1, (step, handle.hook_state.step)
    entry = [handle.state_dict()]
    handle.close()

    torch.manual_seed(0)
    partly = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(partly[0], mesh=mesh["shard"])  # the root and partly[1] never sharded
    with pytest.raises(ValueError, match=r"trainable parameters 1.weight, 1.bias are not sharded"):
        lightning_gradcomp.register_fsdp(partly, mesh, "topk")
    model = _shard(_model(), mesh["shard"])
    model.blocks[0].set_gradient_divide_factor(4.0)
    with pytest.raises(ValueError, match="gradient divide factor"):
        lightning_gradcomp.register_fsdp(model, mesh, "topk")
    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    model.set_requires_all_reduce(False)
    with pytest.raises(ValueError, match="set_requires_gradient_sync"):
        x, y = _batch(0, rank)
        nn.functional.cross_entropy(model(x), y).backward()
    handle.close()

    dist.broadcast_object_list(entry, src=0)
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), other["shard"])
    handle = lightning_gradcomp.register_fsdp(model, other, "topk")
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # said on rank 0 (every rank loads the same entry)
        warnings.simplefilter("always")
        handle.load_state_dict(entry[0])
    if rank == 0:
        assert any("layout hsdp:replicate=2,shard=2 vs hsdp:replicate=1,shard=4" in str(w.message) for w in caught)
    assert not handle.hook_state.memory.residuals, "residuals dropped"
    handle.close()


def check_two_replicas_of_one_shard(rank: int, world_size: int) -> None:
    """A 2 x 1 mesh (every replica one process, FSDP2 with a shard group of one): ``"none"`` equals native
    HSDP on the same mesh bit for bit, and Top-k's replicas end identical."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    _assert_none_equals_native_hsdp(mesh, rank)
    model = _shard(_model(), mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk")
    _train(model, rank)
    local = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    assert torch.equal(gathered[0], gathered[1])
    handle.close()
