"""Issue 40, item 4 (and item 7): work per bucket, not per tensor, where the issue found a per-tensor loop
on the accelerator path — each test fails on the code before the fix it names (docs/benchmarks.md,
"Kernels per bucket (issue 40, item 4)").

Counts are ATen operations of worker 0's exchange of one bucket along the accelerator path
(tests/_op_count.py), a proxy for a GPU's kernel launches.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.compressors.selection import exact_topk, segmented_topk
from lightning_gradcomp.compressors.sparse import sample_many_without_replacement, sample_without_replacement
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.core.segments import Segments
from lightning_gradcomp.exchange.memory import CompressionMemory

from tests._op_count import OpCounter, bound, count_bucket_ops, count_step_ops
from tests.test_segments import _IntoTheGradients

# ---------------------------------------------------------------------------------------------- Top-k, DGC


@pytest.mark.parametrize("name,options,topks", [("topk", {}, 1), ("topk", {"density": 0.001}, 2),
                                                ("dgc", {}, 2), ("dgc", {"density": 0.01}, 1)])
def test_the_segmented_selection_is_one_topk_per_group_of_one_size(name: str, options: dict, topks: int) -> None:
    """Fixed: the block selection took two ``topk`` per pruned tensor (the rows by their peaks, then the
    elements) and one per other tensor; tensors of one size and ``k`` now share each ``topk`` (along the rows
    of a ``(tensors, length)`` view): as many for 100 tensors as for one."""
    counts = [count_bucket_ops(lambda: COMPRESSORS[name](**options), tensors).ops["topk"]
              for tensors in (1, 10, 100)]
    assert counts == [topks] * 3, counts


def test_tensors_of_several_sizes_cost_one_topk_per_size_and_stage() -> None:
    """Three sizes interleaved in name order (so a group's tensors are not neighbours in the buffer): at most
    two ``topk`` per size, however many tensors of each."""
    shapes = [(64, 64), (96, 64), (128, 64)]
    counts = []
    for tensors in (12, 60):
        bucket = {f"layer{index:03d}.weight": shapes[index % 3] for index in range(tensors)}
        counts.append(count_step_ops(lambda: COMPRESSORS["dgc"](density=0.001), [bucket]).ops["topk"])
    assert counts[0] == counts[1] <= 2 * len(shapes), counts


def test_the_segmented_selection_chooses_every_tensors_top_k() -> None:
    """Random layouts mixing pruned and unpruned tensors, sizes that repeat out of order and gaps after the
    segments: every tensor's chosen positions are its top-``k`` (the elements of largest magnitude)."""
    rng = random.Random(0)
    for _ in range(150):
        numels = [rng.choice([64, 100, 561, 1000, 2100, 4096, 16384]) for _ in range(rng.randint(1, 7))]
        density = rng.choice([0.001, 0.002, 0.01, 0.05, 0.2])
        ks = [max(1, round(density * numel)) if rng.random() < 0.8 else rng.randint(1, max(1, numel // 300))
              for numel in numels]
        segments = Segments(tuple(f"t{index}" for index in range(len(numels))),
                            tuple((numel,) for numel in numels), 64)
        flat = torch.zeros(segments.total)
        for view in segments.views(flat):
            view.copy_(torch.randn(view.numel()))
        with accelerator_path():
            positions, finite = segmented_topk(flat, segments, ks)
        assert positions.numel() == sum(ks) and bool(finite.all())
        chosen = positions.split(ks)
        for start, numel, k, mine in zip(segments.starts, segments.numels, ks, chosen):
            expected = set(exact_topk(flat[start:start + numel].abs(), k).tolist())
            assert set((mine - start).tolist()) == expected, (numels, ks)


# ---------------------------------------------------------------------------------------------- Random-k

_DRAWS = ("randint", "_unique2", "randperm")


@pytest.mark.parametrize("options", [{}, {"shared_indices": False}], ids=["shared", "own-indices"])
def test_random_k_draws_per_tensor_on_the_cpu_and_does_the_rest_per_bucket(options: dict) -> None:
    """Fixed: Random-k ran one protocol per tensor on accelerators (a gather, a copy to the device, a
    scatter-add, a select of its residual... per tensor: 1110 operations for 100 tensors). Now its CPU draws
    stay per tensor (each tensor's own seeded generator: three operations on the host, no kernel) and all
    the device work is per bucket: within the budget."""
    counted = {tensors: count_bucket_ops(lambda: COMPRESSORS["randomk"](**options), tensors).ops
               for tensors in (10, 100)}
    draws = {tensors: sum(ops[name] for name in _DRAWS) for tensors, ops in counted.items()}
    rest = {tensors: sum(ops.values()) - draws[tensors] for tensors, ops in counted.items()}
    assert all(draws[tensors] <= 3 * tensors for tensors in counted), draws
    assert rest[10] == rest[100], rest
    assert all(sum(ops.values()) <= bound(tensors) for tensors, ops in counted.items()), counted


def test_the_draws_of_a_bucket_are_each_tensors_own() -> None:
    """The joined draws of several tensors are :func:`sample_without_replacement` of each, from its own
    generator (the seeded contract, ``(seed, step, parameter)``): the same indices on the CPU path."""
    rng = random.Random(1)
    for _ in range(100):
        numels = [rng.randint(1, 5000) for _ in range(rng.randint(1, 6))]
        ks = [rng.randint(1, numel) if rng.random() < 0.3 else max(1, numel // rng.choice([10, 100, 1000]))
              for numel in numels]
        seeds = [rng.randrange(10**6) for _ in numels]
        joined = sample_many_without_replacement(numels, ks, [torch.Generator().manual_seed(seed) for seed in seeds])
        each = [sample_without_replacement(numel, k, torch.Generator().manual_seed(seed))
                for numel, k, seed in zip(numels, ks, seeds)]
        assert torch.equal(joined, torch.cat(each))


# ---------------------------------------------------------------------------------------------- hard threshold


def test_the_hard_threshold_reads_one_count_per_bucket(monkeypatch) -> None:
    """Item 7, fixed: the hard threshold read two sizes per tensor (``nonzero`` of the block peaks, then of
    the elements) along the accelerator path. Now one read of the bucket's counts (``tolist`` of ``P``
    numbers) and ``nonzero_static`` of their known sum, besides the engine's read of the gathered header
    (every worker's count: the layout of the gather); a fixed number of operations."""
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counting(self: torch.Tensor):
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    counted = {}
    for tensors in (10, 100):
        reads.clear()
        counted[tensors] = count_bucket_ops(lambda: COMPRESSORS["threshold"](threshold=1.0), tensors, steps=1).ops
        # per worker (2) and bucket: the compressor's counts and the engine's header
        assert sorted(reads) == sorted([tensors] * 2 + [2] * 2), reads
    for ops in counted.values():
        assert not {"nonzero", "_local_scalar_dense", "masked_select"} & set(ops), dict(ops)
    assert sum(counted[10].values()) == sum(counted[100].values()) <= bound(10)


# ---------------------------------------------------------------------------------------------- hierarchy


def test_the_hierarchy_zeroes_what_a_rank_does_not_own_in_one_operation() -> None:
    """Fixed: a ``zero_()`` per parameter this rank does not own (a kernel each) became one multi-tensor
    ``zero_``."""
    from lightning_gradcomp.ddp.hierarchy import partition, zero_unowned

    bucket = torch.randn(400)
    entries = [SimpleNamespace(grad=bucket[index * 40:(index + 1) * 40]) for index in range(10)]
    shares = partition(entries, [40] * 10, 3)
    before = bucket.clone()
    with OpCounter() as counter:
        zero_unowned(shares, 1)
    assert dict(counter.ops) == {"_foreach_zero_": 1}
    for share, owned in enumerate(shares):
        for entry in owned:
            expected = before[entry.grad.storage_offset():entry.grad.storage_offset() + 40]
            assert torch.equal(entry.grad, expected if share == 1 else torch.zeros(40))


# ---------------------------------------------------------------------------------------------- dense formats


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_a_lone_gradient_is_exchanged_without_a_copy_of_its_own(name: str) -> None:
    """Fixed: ``none``, ``fp16`` and ``bf16`` copied a lone fp32 gradient into a flat buffer, then the
    engine merged it into the all-reduce buffer (a second copy), and the mean went through a buffer of its
    own into the gradient (a third and a fourth). Now the gradient is read as it is and the mean written
    straight back into it: one merge, the division, one write (and the finiteness pass)."""
    elements = 128 * 128
    counted = count_bucket_ops(COMPRESSORS[name], 1, exchange_type=_IntoTheGradients)
    per_element = sum(counted.traffic.values()) / elements
    # none: the merge 8, the division 8, the write 8, the max-norm 4; the casts move 2-byte values in between
    assert per_element <= 30, (per_element, dict(counted.traffic))
    assert counted.ops["cat"] == 1 and "_foreach_copy_" not in counted.ops, dict(counted.ops)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_the_dense_formats_write_their_mean_into_the_gathered_buffer(name: str) -> None:
    """Fixed: the mean of several tensors went into a bucket-sized buffer of its own; the gathered input is
    dead by then (no error feedback) and takes it."""
    counted = count_bucket_ops(COMPRESSORS[name], 10)
    assert "empty" not in counted.ops, dict(counted.ops)


# ---------------------------------------------------------------------------------------------- keep_if_finite


def test_a_residual_kept_under_a_device_flag_is_selected_in_place() -> None:
    """Kept (the select of ``e = p − C(p)`` against the previous residual is a pass over the bucket on a
    GPU, where the flag is not read), but it now writes into ``p``'s own storage: one bucket-sized buffer
    fewer; the same values, the previous residual kept exactly on a void step."""
    memory = CompressionMemory()
    segments = Segments(("a", "b"), ((70,), (30,)), 64)
    grads = [torch.randn(70), torch.randn(30)]
    corrected = memory.compensate_bucket(segments, grads)
    memory.update_bucket(segments, corrected, lambda flat: flat.mul_(0.5), torch.tensor(True))
    previous = {name: memory.residuals[name].clone() for name in segments.names}
    corrected = memory.compensate_bucket(segments, grads)
    expected = corrected.clone().mul_(0.25)
    residual = memory.update_bucket(segments, corrected, lambda flat: flat.mul_(0.25), torch.tensor(True))
    assert residual.data_ptr() == corrected.data_ptr()
    assert torch.equal(residual, expected)
    previous = {name: memory.residuals[name].clone() for name in segments.names}
    corrected = memory.compensate_bucket(segments, [torch.full((70,), math.nan), grads[1]])
    memory.update_bucket(segments, corrected, lambda flat: flat.mul_(0.5), torch.tensor(False))
    for name in segments.names:
        assert torch.equal(memory.residuals[name], previous[name]), name
