"""Quantised all-reduce (int8, int4, fp8, fp4): the average it returns, error feedback on both quantisations,
and bytes on the wire that stay flat in the number of workers while gathered compressors grow."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import QSGD, FP4AllReduce, FP8AllReduce, Int4AllReduce, Int8AllReduce, NoCompression
from lightning_gradcomp.compressors.quantised import OWNER_RESIDUAL, _ChunkPlan
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.simulation import SimulatedExchange

#: Relative error of one step's average for Gaussian gradients (block size 256): about half a code step.
ONE_STEP_ERROR = {"int8": 0.02, "int4": 0.3, "fp8": 0.08, "fp4": 0.3, "fp4-e2m1": 0.3}
MAKERS = {"int8": Int8AllReduce, "int4": Int4AllReduce, "fp8": FP8AllReduce, "fp4": FP4AllReduce,
          "fp4-e2m1": lambda: FP4AllReduce(format="e2m1")}


def _grads(workers: int, step: int, numel: int = 5000) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + w)) for w in range(workers)]


def _step(exchange: SimulatedExchange, grads: list[torch.Tensor]) -> torch.Tensor:
    for worker, grad in enumerate(grads):
        exchange.add_worker(worker, [("w", grad)])
    return exchange.finish_step()["w"]


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_one_step_returns_the_average_within_the_codes_precision(name: str, workers: int) -> None:
    exchange = SimulatedExchange(MAKERS[name](), workers, min_compress_numel=1)
    grads = _grads(workers, 0)
    aggregate, mean = _step(exchange, grads), torch.stack(grads).mean(0)
    assert float((aggregate - mean).norm() / mean.norm()) < ONE_STEP_ERROR[name]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_error_feedback_on_both_quantisations_keeps_the_running_sum(name: str) -> None:
    """With both residuals, sum_t aggregate_t = sum_t mean_t - (residuals): the error of the running sum
    stays bounded instead of growing with the steps."""
    workers, steps = 4, 20
    exchange = SimulatedExchange(MAKERS[name](), workers, min_compress_numel=1)
    total_aggregate = torch.zeros(5000)
    total_mean = torch.zeros(5000)
    for step in range(steps):
        grads = _grads(workers, step)
        total_aggregate += _step(exchange, grads)
        total_mean += torch.stack(grads).mean(0)
    relative = float((total_aggregate - total_mean).norm() / total_mean.norm())
    assert relative < ONE_STEP_ERROR[name] / 2, relative
    assert all(OWNER_RESIDUAL in p.memory.states["w"] for p in exchange.pipelines)


def _wire_bytes(compressor, workers: int, numel: int = 2**16) -> float:
    """Bytes one worker puts on a ring network in one step (the network model at zero latency)."""
    exchange = SimulatedExchange(compressor, workers, min_compress_numel=1)
    _step(exchange, _grads(workers, 0, numel))
    network = Network(bandwidth_gbps=8e-9, latency_us=0)  # 1 byte per second
    return network.step_time(exchange.step_stats.collectives, workers)


def test_bytes_on_the_wire_stay_flat_in_the_number_of_workers_where_gathering_grows() -> None:
    numel = 2**16
    dense_allreduce = [2 * (n - 1) / n * 4 * numel for n in (2, 4, 8, 16)]
    int8 = [_wire_bytes(Int8AllReduce(), n, numel) for n in (2, 4, 8, 16)]
    qsgd = [_wire_bytes(QSGD(levels=16), n, numel) for n in (2, 4, 8, 16)]
    for ring, quantised in zip(dense_allreduce, int8):  # the all-reduce's shape at a quarter of the bytes
        assert ring / 4 <= quantised <= ring / 4 * 1.05, (ring, quantised)
    assert qsgd[-1] > 7 * qsgd[0]  # every worker receives N - 1 payloads
    assert qsgd[0] < int8[0] and qsgd[-1] > int8[-1]  # 6-bit QSGD stops paying between 2 and 16 workers


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("workers", [2, 4, 8])
def test_bytes_sent_against_fp32_are_the_formats_ratio_whatever_the_workers(name: str, workers: int) -> None:
    """``step_stats`` counts what leaves each worker: the all-to-all's rows for the N - 1 others and the
    all-gather of its own re-quantised chunk, ``d (b/8 + 4/B)`` in all, plus the finiteness flag: against
    fp32, 3.9x at 8 bits and 7.8x at 4 bits, at every N (counting the all-to-all's own row, which never
    leaves the worker, int8 read 2.6x at 2 workers and 3.1x at 4)."""
    numel = 2**16  # whole chunks of whole blocks up to 8 workers: nothing padded
    code_bytes = 0.5 if name.startswith(("int4", "fp4")) else 1.0
    quantised = SimulatedExchange(MAKERS[name](), workers, min_compress_numel=1)
    dense = SimulatedExchange(NoCompression(), workers, min_compress_numel=1)
    grads = _grads(workers, 0, numel)
    _step(quantised, grads)
    _step(dense, grads)
    # the bucket's fp32 finiteness flag: in the all-gather's buffer (aligned to 8 bytes), in the dense all-reduce
    assert quantised.step_stats.bytes_sent == numel * (code_bytes + 4 / 256) + 8
    assert dense.step_stats.bytes_sent == 4 * numel + 4
    ratio = 4 / (code_bytes + 4 / 256)  # to within the flags' few bytes
    assert quantised.step_stats.compression_ratio == pytest.approx(ratio, rel=1e-3)
    assert dense.step_stats.bytes_sent / quantised.step_stats.bytes_sent == pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_blocks_of_zeros_and_of_denormal_values_stay_finite(name: str) -> None:
    """A block whose peak divided by the code range underflows must not become 0/0 = NaN."""
    grad = torch.zeros(1024)
    grad[256:512] = 1e-43  # denormal
    grad[512] = 1e-40
    grad[768:] = torch.randn(256)
    aggregate = _step(SimulatedExchange(MAKERS[name](), 2, min_compress_numel=1), [grad, grad.clone()])
    assert torch.isfinite(aggregate).all()
    assert torch.equal(aggregate[:256], torch.zeros(256))
    assert float((aggregate[768:] - grad[768:]).norm() / grad[768:].norm()) < ONE_STEP_ERROR[name]


def test_fp8_formats_and_bad_arguments() -> None:
    assert FP8AllReduce(format="e5m2").code_max == 57344.0
    with pytest.raises(ValueError, match="`format` must be 'e4m3' or 'e5m2'"):
        FP8AllReduce(format="e3m4")
    with pytest.raises(ValueError, match="`block_size` must be an integer >= 1"):
        Int8AllReduce(block_size=0)


@pytest.mark.parametrize("format,values", [
    ("e2m1", (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)),
    ("e3m0", (0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)),
])
def test_fp4_rounds_to_the_nearest_value_ties_to_the_even_magnitude_and_keeps_signs(format: str, values) -> None:
    """Every midpoint between neighbouring values (a tie) goes to the value of even magnitude index, every
    value next to a midpoint to its nearest value, on both sides of zero; tiny negatives decode as
    ``-0.0`` (``-0.0`` itself equals 0: ``+0.0``). The block's peak (``F``, the format's largest value)
    fixes the scale at 1."""
    compressor = FP4AllReduce(format=format, block_size=8)
    top = values[-1]
    probes, expected = [], []
    for index in range(len(values) - 1):
        low, high = values[index], values[index + 1]
        middle = torch.tensor((low + high) / 2)
        even = low if index % 2 == 0 else high
        for value, want in ((middle, even), (torch.nextafter(middle, torch.tensor(0.0)), low),
                            (torch.nextafter(middle, torch.tensor(10.0)), high)):
            probes += [float(value), -float(value)]
            expected += [want, -want]
    probes += [-0.0, -1e-30, 1e-30]
    expected += [0.0, -0.0, 0.0]
    blocks = torch.tensor(probes)
    blocks = torch.cat([blocks, torch.zeros(-blocks.numel() % 7)]).view(-1, 7)
    blocks = torch.cat([torch.full((blocks.shape[0], 1), top), blocks], dim=1)  # each block's peak: F
    decoded = compressor._decode(*compressor._encode(blocks))[:, 1:].reshape(-1)[: len(probes)]
    assert decoded.tolist() == expected
    assert torch.equal(torch.signbit(decoded), torch.signbit(torch.tensor(expected)))
    for hold in (False, True):  # the bucket-wise codec agrees
        codes, scales, sent = compressor._quantise_rows(blocks.view(1, -1, 8), hold=hold)
        assert torch.equal(compressor._dequantise_rows(codes, scales).view(-1, 8), compressor._decode(
            *compressor._encode(blocks)))
        assert torch.equal(sent().view(-1, 8), compressor._decode(*compressor._encode(blocks)))


def test_fp4_formats_and_bad_arguments() -> None:
    assert FP4AllReduce(format="e2m1").code_max == 6.0
    with pytest.raises(ValueError, match="`format` must be 'e3m0' or 'e2m1'"):
        FP4AllReduce(format="e4m3")


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("numel", [4 * 256 * 3, 5 * 256, 5000, 200],
                         ids=["whole-chunks", "zero-blocks", "gap-in-last-block", "one-block"])
def test_a_lone_tensor_takes_the_bucket_path_without_an_index_and_equals_the_per_tensor_path(name: str,
                                                                                           numel: int) -> None:
    """A bucket with one compressed tensor (a large layer fills one of DDP's buckets) is chunked in place:
    its blocks then zero blocks, no index; bit for bit the per-tensor protocol's results, residuals and owner
    residuals, over steps (4 workers: chunks of whole blocks, the last ones padded or empty)."""
    from lightning_gradcomp.core.device import accelerator_path

    runs = []
    for segmented in (False, True):
        exchange = SimulatedExchange(MAKERS[name](), workers=4, min_compress_numel=1)
        for engine in exchange.engines:
            engine.segmented = segmented
        with accelerator_path():
            results = [_step(exchange, _grads(4, step, numel)) for step in range(3)]
        runs.append((results, exchange))
    (expected, reference), (actual, bucketed) = runs
    plans = [value for layout in bucketed.engines[0]._layouts.values() for value in layout._constants.values()
             if isinstance(value, _ChunkPlan)]
    assert plans and all(plan.gather is None and plan.scatter is None for plan in plans)
    for want, got in zip(expected, actual):
        assert torch.equal(want, got)
    for worker in range(4):
        want_memory, got_memory = reference.pipelines[worker].memory, bucketed.pipelines[worker].memory
        assert torch.equal(want_memory.residuals["w"], got_memory.residuals["w"])
        assert torch.equal(want_memory.states["w"][OWNER_RESIDUAL], got_memory.states["w"][OWNER_RESIDUAL])
