"""Error feedback (exact invariant, NaN guard, checkpoint round trip) and the byte layout of payloads."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import QSGD, CompressContext, HardThreshold, RandomK, TopK
from lightning_gradcomp.core.tensors import all_finite
from lightning_gradcomp.exchange import wire
from lightning_gradcomp.exchange.memory import CompressionMemory


def _subtract(compressor, payload):
    return lambda residual: compressor.accumulate(payload, residual, alpha=-1.0)


@pytest.mark.parametrize("compressor", [TopK(0.05), RandomK(0.05), RandomK(0.05, False), HardThreshold(0.8)])
def test_error_feedback_invariant_is_exact_for_sparsifiers(compressor) -> None:
    memory = CompressionMemory()
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        grad = torch.randn(2000, generator=generator)
        corrected = memory.compensate("w", grad)
        expected_p = grad + memory.residuals["w"] if "w" in memory.residuals else grad
        assert torch.equal(corrected, expected_p)
        payload = compressor.compress(corrected, CompressContext("w", step=step))
        sent = compressor.decompress(payload)
        p = corrected.clone()
        residual = memory.update("w", corrected, _subtract(compressor, payload))
        assert torch.equal(sent + residual, p), "C(p) + e_{t+1} == p must hold bit for bit"
        assert torch.all(residual[sent != 0] == 0)


def test_error_feedback_reuses_two_buffers_on_cpu_and_a_void_step_keeps_the_residual_exactly() -> None:
    memory, compressor = CompressionMemory(), TopK(0.01)
    generator = torch.Generator().manual_seed(0)
    storages = set()
    for step in range(5):
        corrected = memory.compensate("w", torch.randn(5000, generator=generator))
        storages.add(corrected.data_ptr())
        memory.update("w", corrected, _subtract(compressor, compressor.compress(corrected, CompressContext("w"))))
    assert len(storages) == 2, "p and e alternate between two buffers instead of a fresh tensor per step"
    before = memory.residuals["w"].clone()
    corrected = memory.compensate("w", torch.randn(5000, generator=generator))
    memory.update("w", corrected, _subtract(compressor, compressor.compress(corrected, CompressContext("w"))),
                  finite=False)  # another worker's gradient was not finite: the step is void
    assert torch.equal(memory.residuals["w"], before)
    corrected = memory.compensate("w", torch.zeros(5000))
    assert torch.equal(corrected, before), "the next step starts from the kept residual"


def test_error_feedback_invariant_for_a_quantiser_up_to_rounding() -> None:
    memory, compressor = CompressionMemory(), QSGD(levels=4)
    for step in range(3):
        corrected = memory.compensate("w", torch.randn(1000))
        p = corrected.clone()
        payload = compressor.compress(corrected, CompressContext("w", step=step))
        residual = memory.update("w", corrected, _subtract(compressor, payload))
        torch.testing.assert_close(compressor.decompress(payload) + residual, p)


def test_a_non_finite_step_leaves_the_residual_unchanged() -> None:
    memory, compressor = CompressionMemory(), TopK(0.1)
    grad = torch.randn(100)
    memory.update("w", memory.compensate("w", grad), _subtract(compressor, compressor.compress(grad, CompressContext("w"))))
    before = memory.residuals["w"].clone()
    bad = torch.randn(100)
    bad[3], bad[50] = float("nan"), float("inf")
    assert all_finite(bad) is False and all_finite(grad) is True
    corrected = memory.compensate("w", bad)
    kept = memory.update("w", corrected, _subtract(compressor, compressor.compress(corrected, CompressContext("w"))),
                         finite=all_finite(bad))
    assert kept is None and torch.equal(memory.residuals["w"], before)
    flag = torch.tensor(False)  # accelerators: a 0-d flag, selected element-wise without a host sync
    corrected = memory.compensate("w", bad)
    memory.update("w", corrected, _subtract(compressor, compressor.compress(corrected, CompressContext("w"))), flag)
    assert torch.equal(memory.residuals["w"], before)


def test_memory_state_dict_roundtrip() -> None:
    memory = CompressionMemory()
    memory.residuals["a"] = torch.randn(4)
    memory.state("b")["momentum"] = torch.randn(3)
    restored = CompressionMemory()
    restored.load_state_dict(memory.state_dict(), torch.device("cpu"))
    assert torch.equal(restored.residuals["a"], memory.residuals["a"])
    assert torch.equal(restored.states["b"]["momentum"], memory.states["b"]["momentum"])


def test_wire_layout_aligns_parts_and_roundtrips_mixed_dtypes() -> None:
    compressor = TopK(0.01)
    shapes = [(1000, 10), (333, 3), (5000, 50)]
    slots, total = wire.layout([list(zip(compressor.part_dtypes(torch.float64), compressor.payload_numels(*shape)))
                                for shape in shapes])
    assert total % wire.ALIGNMENT == 0
    for payload_slots in slots:
        for slot in payload_slots:
            assert slot.offset % torch.empty((), dtype=slot.dtype).element_size() == 0
    parts = [(torch.randn(count, dtype=torch.float64), torch.randint(0, numel, (count,), dtype=torch.int32))
             for numel, count in shapes]
    buffer = wire.serialize(parts, slots, total, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == total
    assert total - sum(p.numel() * p.element_size() for pp in parts for p in pp) < 8 * len(shapes)
    for original, decoded in zip(parts, wire.deserialize(buffer, slots)):
        assert all(torch.equal(a, b) for a, b in zip(original, decoded))


def test_wire_layout_with_qsgd_bytes_and_float_norms() -> None:
    compressor = QSGD(levels=16, bucket_size=512)
    x = torch.randn(777)
    payload = compressor.compress(x, CompressContext("w"))
    slots, total = wire.layout([[(part.dtype, part.numel()) for part in payload.parts]])
    decoded = wire.deserialize(wire.serialize([payload.parts], slots, total, torch.device("cpu")), slots)[0]
    assert all(torch.equal(a, b) for a, b in zip(payload.parts, decoded))


@pytest.mark.parametrize("cast", ["fp16", "bf16"])
def test_a_cast_sends_a_bucket_with_small_tensors_in_one_16_bit_all_reduce(cast: str) -> None:
    """Small tensors (below min_compress_numel) ride in the same 16-bit all-reduce as the rest: one
    collective per bucket, 2 bytes per element plus the finiteness flag."""
    from lightning_gradcomp.compressors import COMPRESSORS
    from lightning_gradcomp.simulation import SimulatedExchange

    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[cast]
    exchange = SimulatedExchange(COMPRESSORS[cast](), workers=2, min_compress_numel=100)
    exchange.telemetry = True
    generator = torch.Generator().manual_seed(0)
    grads = [[("w", torch.randn(30, 20, generator=generator)), ("b", torch.randn(30, generator=generator) / 3)]
             for _ in range(2)]
    for worker in range(2):
        exchange.add_worker(worker, grads[worker])
    aggregate = exchange.finish_step()
    assert exchange.step_stats.collectives == [("all_reduce", 2 * (600 + 30 + 1))]
    for name, index in (("w", 0), ("b", 1)):
        halves = [(grads[worker][index][1].reshape(-1) / 2).to(wire_dtype) for worker in range(2)]
        assert torch.equal(aggregate[name], (halves[0] + halves[1]).float())
