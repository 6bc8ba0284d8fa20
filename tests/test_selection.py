"""Selection of the largest magnitudes by block maxima (exact set), the pruned hard threshold, and the
compressors that use them: the same coordinates as exact ``torch.topk`` / ``nonzero``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import DGC, HardThreshold, TopK
from lightning_gradcomp.compressors.base import CompressContext
from lightning_gradcomp.compressors.dgc import MOMENTUM, VELOCITY
from lightning_gradcomp.compressors.selection import (
    block_layout,
    block_topk,
    select_threshold,
    select_topk,
    threshold_indices,
    topk_indices,
)
from lightning_gradcomp.core.tensors import all_finite


def _tensor(distribution: str, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    if distribution == "heavy":  # most of the mass in a few elements
        x = x * torch.rand(numel, generator=generator) ** 8
    elif distribution == "mostly_zero":  # ties at zero beyond the nonzeros
        x[torch.rand(numel, generator=generator) < 0.999] = 0.0
    elif distribution == "large_tail":  # the largest elements in the short last block
        x[-3:] = 100.0
    elif distribution == "one_region":  # a layer whose large gradients sit together
        x[: numel // 10] *= 1000.0
    elif distribution == "fp16":
        x = x.half()
    return x


def _assert_topk_set(x: torch.Tensor, indices: torch.Tensor, k: int) -> None:
    assert indices.numel() == k and indices.unique().numel() == k
    chosen = x.abs().float()[indices].sort(descending=True).values
    assert torch.equal(chosen, torch.topk(x.abs().float(), k).values), "not a top-k set"


@pytest.mark.parametrize("distribution", ["gaussian", "heavy", "mostly_zero", "large_tail", "one_region", "fp16"])
@pytest.mark.parametrize("numel", [1_000, 4_099, 100_003])
@pytest.mark.parametrize("density", [0.0005, 0.001, 0.01, 0.05, 0.3])
@pytest.mark.parametrize("prune", [True, False])
def test_block_topk_returns_a_top_k_set(distribution: str, numel: int, density: float, prune: bool) -> None:
    x = _tensor(distribution, numel, seed=numel)
    k = max(1, round(density * numel))
    _assert_topk_set(x, block_topk(x, k, prune=prune), k)


@pytest.mark.parametrize("density", [0.001, 0.01])
def test_block_topk_on_a_large_tensor(density: float) -> None:
    x = _tensor("heavy", 1_000_000, seed=1)
    k = round(density * x.numel())
    _assert_topk_set(x, block_topk(x, k), k)


def test_layouts_cover_contiguous_strided_and_exact() -> None:
    assert block_layout(1_000, 1_000_000) == (64, True)
    assert block_layout(10_000, 1_000_000) == (8, False)
    size, contiguous = block_layout(50_000, 1_000_000)
    assert not contiguous and 50_000 * size > 1_000_000 // 4  # falls back to exact topk


def test_block_topk_on_a_non_finite_tensor_still_returns_k_distinct_indices() -> None:
    x = torch.randn(100_000)
    x[[5, 17]] = float("nan")
    x[99] = float("inf")
    for prune in (True, False):
        indices = block_topk(x, 100, prune=prune)
        assert indices.numel() == 100 and indices.unique().numel() == 100


@pytest.mark.parametrize("threshold", [0.0, 0.5, 2.5, 3.5, 10.0, float("inf")])
@pytest.mark.parametrize("numel", [5, 64, 65, 1_000, 100_003])
def test_pruned_threshold_equals_nonzero_in_order(threshold: float, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    assert torch.equal(threshold_indices(x, threshold), torch.nonzero(x.abs() >= threshold).view(-1))


def test_selections_send_the_same_coordinates() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(3))
    k = 200
    expected = set(torch.topk(x.abs(), k).indices.tolist())
    for selection in ("blocks", "exact", "sampled"):
        generator = torch.Generator().manual_seed(0)
        assert set(topk_indices(x, k, selection, generator).tolist()) == expected
        payload = TopK(0.001, selection=selection).compress(x, CompressContext("w", step=1))
        assert set(payload.parts[1].tolist()) == expected


def test_dgc_with_block_selection_trains_bit_for_bit_like_exact_selection() -> None:
    """Blocks and exact topk choose the same coordinates, so DGC's state and payloads are identical."""
    generator = torch.Generator().manual_seed(7)
    states = {"blocks": {}, "exact": {}}
    for step in range(6):
        grad = torch.randn(50_000, generator=generator)
        sent = {}
        for selection, state in states.items():
            payload = DGC(0.002, momentum=0.9, selection=selection).compress(grad, CompressContext("w", step=step,
                                                                                                   state=state))
            sent[selection] = DGC(0.002).decompress(payload)
        assert torch.equal(sent["blocks"], sent["exact"])
        for key in (MOMENTUM, VELOCITY):
            assert torch.equal(states["blocks"][key], states["exact"][key])


def test_hard_threshold_payload_is_unchanged_by_pruning() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    payload = HardThreshold(3.0).compress(x, CompressContext("w"))
    expected = torch.nonzero(x.abs() >= 3.0).view(-1)
    assert torch.equal(payload.parts[1], expected.to(torch.int32))
    assert torch.equal(payload.parts[0], x[expected])


def test_bad_selection_is_refused_naming_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="`selection` must be one of 'blocks', 'sampled', 'exact'"):
        TopK(0.01, selection="fast")


@pytest.mark.parametrize("numel,density", [(64_017, 0.001), (10_000, 0.05), (1_000, 0.5), (40, 0.1)])
@pytest.mark.parametrize("where", ["nowhere", "first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selections_say_whether_the_tensor_was_finite_as_all_finite_does(
        numel: int, density: float, where: str, bad: float, dtype: torch.dtype) -> None:
    """Contiguous blocks with a tail, strided blocks, the exact fallback and a tensor without a whole
    block: the finiteness read from the block peaks (and the tail) is the engine's own check's."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    if where != "nowhere":
        x[{"first": 0, "middle": numel // 2, "last": numel - 1}[where]] = bad
    k = max(1, round(density * numel))
    expected = all_finite(x)
    assert expected is (where == "nowhere")
    chosen = select_topk(x, k)
    assert chosen.finite is expected
    if expected:
        assert torch.equal(chosen.indices, block_topk(x, k)), "reporting changes nothing else"
    assert select_topk(x, k, "exact").finite is expected
    assert select_threshold(x, 1.0).finite is expected
    if expected:
        assert torch.equal(select_threshold(x, 1.0).indices, torch.nonzero(x.abs() >= 1.0).view(-1))
