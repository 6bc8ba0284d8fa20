"""Single-process tests of the compressors: selection, wire sizes, unbiasedness, round trips."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp.compressors import (
    BF16,
    FP16,
    QSGD,
    CompressContext,
    HardThreshold,
    NoCompression,
    RandomK,
    TopK,
    get_compressor,
)
from lightning_gradcomp.compressors.bitpack import (
    pack,
    pack_grouped,
    pack_rows,
    packed_nbytes,
    unpack,
    unpack_grouped,
    unpack_rows,
)


def ctx(step: int = 0, rank: int = 0, name: str = "w") -> CompressContext:
    return CompressContext(name=name, step=step, rank=rank, world_size=2, seed=0)


def test_topk_selects_exactly_the_largest_magnitudes() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    payload = TopK(density=0.01).compress(x, ctx())
    values, indices = payload.parts
    expected = set(torch.argsort(x.abs(), descending=True)[:100].tolist())
    assert payload.count == 100 and set(indices.tolist()) == expected
    assert torch.equal(values, x[indices.long()])
    assert indices.dtype == torch.int32 and values.dtype == torch.float32


def test_hard_threshold_selects_exactly_elements_at_or_above_lambda() -> None:
    x = torch.tensor([0.5, -0.2, 0.1, -0.7, 0.3, 0.0])
    payload = HardThreshold(threshold=0.3).compress(x, ctx())
    assert sorted(payload.parts[1].tolist()) == [0, 3, 4]
    assert payload.count == 3
    assert HardThreshold(threshold=1.0).compress(x, ctx()).count == 0  # zero is a valid count
    assert HardThreshold().static_count(6) is None


def test_randomk_indices_are_unique_shared_and_fresh_each_step() -> None:
    x = torch.randn(5000)
    compressor = RandomK(density=0.1)
    state = torch.random.get_rng_state()
    a = compressor.compress(x, ctx(step=3, rank=0))
    b = compressor.compress(x, ctx(step=3, rank=1))
    c = compressor.compress(x, ctx(step=4, rank=0))
    assert torch.equal(torch.random.get_rng_state(), state), "Random-k must not touch the global RNG"
    assert a.meta.unique().numel() == a.meta.numel() == 500
    assert torch.equal(a.meta, b.meta), "shared indices are identical on every rank"
    assert not torch.equal(a.meta, c.meta), "indices change from step to step"
    assert compressor.all_reducible and len(a.parts) == 1
    own = RandomK(density=0.1, shared_indices=False)
    d, e = own.compress(x, ctx(step=3, rank=0)), own.compress(x, ctx(step=3, rank=1))
    assert not own.all_reducible and not torch.equal(d.parts[1], e.parts[1])
    assert d.parts[1].unique().numel() == 500


@pytest.mark.parametrize("compressor", [TopK(0.05), RandomK(0.05), RandomK(0.05, False), HardThreshold(1.0),
                                        NoCompression(), FP16(), BF16(), QSGD(levels=4, bucket_size=64)])
def test_payload_parts_match_the_declared_wire_format(compressor) -> None:
    x = torch.randn(3000)
    payload = compressor.compress(x, ctx())
    numels = compressor.payload_numels(x.numel(), payload.count)
    assert tuple(p.numel() for p in payload.parts) == numels
    assert tuple(p.dtype for p in payload.parts) == compressor.part_dtypes(x.dtype)
    static = compressor.static_count(x.numel())
    assert static is None or static == payload.count


def test_decompress_roundtrips() -> None:
    x = torch.randn(1000)
    assert torch.equal(NoCompression().decompress(NoCompression().compress(x, ctx())), x)
    assert torch.equal(FP16().decompress(FP16().compress(x, ctx())), x.half().float())
    assert torch.equal(BF16().decompress(BF16().compress(x, ctx())), x.bfloat16().float())
    sparse = TopK(0.1).decompress(TopK(0.1).compress(x, ctx()))
    assert (sparse != 0).sum() == 100 and torch.equal(sparse[sparse != 0], x[sparse != 0])


@pytest.mark.parametrize("levels,bucket_size", [(1, 512), (4, 512), (16, 100), (64, 512), (255, 37)])
def test_qsgd_is_unbiased_within_statistical_tolerance(levels: int, bucket_size: int) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    compressor = QSGD(levels=levels, bucket_size=bucket_size)
    draws = 2000
    total = torch.zeros(1000, dtype=torch.float64)
    for step in range(draws):
        total += compressor.decompress(compressor.compress(x, ctx(step=step))).double()
    mean = total / draws
    # Each element is rounded between two adjacent levels norm/s apart: its variance is <= (norm/s)^2 / 4.
    norms = torch.stack([chunk.norm() for chunk in x.split(bucket_size)])
    spacing = torch.repeat_interleave(norms / levels, torch.tensor([len(c) for c in x.split(bucket_size)]))
    standard_error = spacing.double() / 2 / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= 5 * standard_error + 1e-6)


@pytest.mark.parametrize("levels", [1, 4, 16, 127, 1000, 2**30])
def test_qsgd_values_lie_on_the_levels_and_keep_sign(levels: int) -> None:
    x = torch.randn(512)
    compressor = QSGD(levels=levels, bucket_size=512)
    out = compressor.decompress(compressor.compress(x, ctx()), torch.float64)
    norm = x.norm().double()  # the fp32 norm on the wire
    scaled = out.abs() / norm * levels
    tolerance = 1e-4 + 1e-6 * scaled  # fp32 arithmetic at large s
    assert torch.all((scaled - scaled.round()).abs() <= tolerance)
    assert torch.all((out == 0) | (out.sign() == x.sign()))
    # each value is one of the two levels around s|x_i|/||x||
    exact = x.double().abs() / norm * levels
    assert torch.all((scaled >= exact.floor() - tolerance) & (scaled <= exact.ceil() + tolerance))
    assert torch.equal(compressor.decompress(compressor.compress(torch.zeros(512), ctx())), torch.zeros(512))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_qsgd_accumulates_into_buckets_of_other_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(1500)
    compressor = QSGD(levels=16, bucket_size=512)
    payload = compressor.compress(x.to(dtype), ctx())
    reference = compressor.decompress(payload, torch.float32)
    out = torch.ones(1500, dtype=dtype)
    compressor.accumulate(payload, out, alpha=0.5)
    assert torch.allclose(out.float(), 1 + 0.5 * reference, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", [4, 6])
def test_narrow_codes_are_packed_in_lanes(bits: int) -> None:
    """The documented stream: g lanes of n/g codes; byte plane i holds bits 8i..8i+7 of each position's
    little-endian concatenation of the lanes' codes."""
    codes = torch.randint(0, 2**bits, (32,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits).to(torch.int64)
    group, width = (2, 1) if bits == 4 else (4, 3)
    lanes = codes.to(torch.int64).view(group, -1)
    words = sum(lanes[j] << (j * bits) for j in range(group))
    expected = torch.stack([(words >> (8 * i)) & 0xFF for i in range(width)])
    assert torch.equal(packed.view(width, -1), expected)


@pytest.mark.parametrize("levels,bits", [(1, 2), (4, 4), (15, 5), (16, 6), (64, 8), (255, 9), (65535, 17)])
def test_qsgd_packed_size_is_ceil_log2_levels_plus_sign_bits_per_element(levels: int, bits: int) -> None:
    numel, bucket_size = 10_000, 512
    compressor = QSGD(levels=levels, bucket_size=bucket_size)
    assert compressor.bits == math.ceil(math.log2(levels + 1)) + 1 == bits
    norms, packed = compressor.compress(torch.randn(numel), ctx()).parts
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8) * bits
    assert norms.dtype == torch.float32 and norms.numel() == math.ceil(numel / bucket_size)
    expected = math.ceil(numel / 8) * bits + 4 * math.ceil(numel / bucket_size)
    assert compressor.payload_nbytes(numel, numel) == expected
    assert 4 * numel / expected == pytest.approx(32 / (bits + 32 / bucket_size), rel=1e-2)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 32])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1001])
def test_bitpack_roundtrip(bits: int, numel: int) -> None:
    codes = torch.randint(0, 2**bits, (numel,), dtype=torch.int64)
    packed = pack(codes, bits)
    assert packed.numel() == packed_nbytes(numel, bits)
    assert torch.equal(unpack(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", [1, 3, 4, 8, 9, 10, 12, 13, 16, 20, 32])
@pytest.mark.parametrize("numel", [1, 7, 8, 33])
def test_rows_packed_apart_unpack_together(bits: int, numel: int) -> None:
    """pack_rows (the bucket-wise index format): ``⌈n/8⌉·bits`` bytes per row, each row's bytes its own
    (one worker's row packed alone is that row of the batch), and unpacking a strided view of gathered
    rows gives every row's codes back."""
    codes = torch.randint(0, 2**bits, (3, numel), dtype=torch.int64)
    packed = pack_rows(codes, bits)
    assert packed.shape == (3, packed_nbytes(numel, bits)) and packed.dtype == torch.uint8
    assert all(torch.equal(pack_rows(codes[row], bits), packed[row]) for row in range(3))
    gathered = torch.zeros(3, packed.shape[1] + 4, dtype=torch.uint8)  # rows of a gathered buffer, padded
    gathered[:, :packed.shape[1]] = packed
    assert torch.equal(unpack_rows(gathered[:, :packed.shape[1]], bits, numel), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_grouped_codes_are_each_groups_little_endian_word(bits: int) -> None:
    """pack_grouped (the bucket-wise quantisers' format): each group of g codes fills w bytes, byte i holding
    bits 8i..8i+7 of ``Σ_j c_j·2^(j·bits)``, row by row; unpacking a strided view of gathered rows gives the
    codes back, in their integer dtype or the one asked for."""
    group = 8 // math.gcd(8, bits)
    width = group * bits // 8
    codes = torch.randint(0, 2**bits, (3, 8 * 41), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    words = (codes.to(torch.int64).view(3, -1, group) << (torch.arange(group) * bits)).sum(-1, keepdim=True)
    expected = ((words >> (torch.arange(width) * 8)) & 0xFF).to(torch.uint8).view(3, -1)
    packed = pack_grouped(codes, bits)
    assert torch.equal(packed, expected)
    gathered = torch.zeros(3, packed.shape[1] + 5, dtype=torch.uint8)
    gathered[:, 2:2 + packed.shape[1]] = packed
    rows = gathered[:, 2:2 + packed.shape[1]]
    assert torch.equal(unpack_grouped(rows, bits, None).to(torch.int64), codes.to(torch.int64))
    assert unpack_grouped(rows, bits, torch.float32).dtype == torch.float32


def test_names_build_default_instances() -> None:
    assert isinstance(get_compressor("topk"), TopK)
    assert isinstance(get_compressor("QSGD"), QSGD)
    instance = TopK(0.5)
    assert get_compressor(instance) is instance


def test_cpu_noise_is_uniform_on_a_16_bit_grid_strictly_inside_the_unit_interval() -> None:
    from lightning_gradcomp.compressors.qsgd import offset_uniform

    u = offset_uniform(400_000, 3.0, torch.float32, torch.Generator().manual_seed(0), torch.device("cpu")) - 3.0
    assert u.min() > 0 and u.max() < 1
    grid = u * 2**16 - 0.5
    assert torch.equal(grid, grid.round()), "u = (r + 1/2) / 2^16"
    counts = torch.bincount((u * 16).long(), minlength=16).double()
    assert ((counts - 25_000).abs() < 5 * 25_000**0.5).all(), counts  # 16 equal bins, within 5 sigma
    again = offset_uniform(400_000, 3.0, torch.float32, torch.Generator().manual_seed(0), torch.device("cpu")) - 3.0
    assert torch.equal(u, again), "the same generator state draws the same noise"


def test_scratch_tensors_are_reused_per_tag_and_thread_and_never_reach_a_payload() -> None:
    import threading

    from lightning_gradcomp.compressors.scratch import scratch

    first = scratch("test.a", 1000, torch.float32, torch.device("cpu"))
    assert scratch("test.a", 500, torch.float32, torch.device("cpu")).data_ptr() == first.data_ptr()
    assert scratch("test.b", 500, torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr()
    assert scratch("test.a", 2000, torch.float32, torch.device("cpu")).numel() == 2000  # grows
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(scratch("test.a", 10, torch.float32,
                                                                  torch.device("cpu")).data_ptr()))
    thread.start()
    thread.join()
    assert other[0] != scratch("test.a", 10, torch.float32, torch.device("cpu")).data_ptr()
    # QSGD quantises through scratch tensors: a payload kept across later calls is not overwritten
    compressor, x = QSGD(levels=16, bucket_size=100), torch.randn(1003)
    payload = compressor.compress(x, ctx(step=0))
    kept = [part.clone() for part in payload.parts]
    decoded = compressor.decompress(payload)
    compressor.compress(torch.randn(1003), ctx(step=1))
    assert all(torch.equal(part, copy) for part, copy in zip(payload.parts, kept))
    assert torch.equal(compressor.decompress(payload), decoded)
