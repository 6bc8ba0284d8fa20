"""SparseLoCo's compressor against a float64 reference of its steps (2 workers, several steps), its wire
format counted at the collective, padding, the two aggregations, and its recipe end to end."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.compressors import SparseLoCo
from lightning_gradcomp.compressors.bitpack import packed_nbytes
from lightning_gradcomp.compressors.sparseloco import ACCUMULATOR, _ChunkGroups
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.core.segments import Segments
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from tests.test_recipes import ROOT, _run_cli


def _reference_step(inputs: list[torch.Tensor], accumulators: list, chunk: int, k: int, bits,
                    decay: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The steps of SparseLoCo's compressor written out in float64: accumulate with decay, chunk-wise
    top-k of |A|, quantise around the mean in steps of 6σ/2^b with a per-bin lookup of means, remove what
    was sent from A, average each coordinate over the workers that chose it."""
    numel = inputs[0].numel()
    total = torch.zeros(numel, dtype=torch.float64)
    chosen = torch.zeros(numel, dtype=torch.float64)
    new_accumulators = []
    for x, previous in zip(inputs, accumulators):
        acc = x.double() + (decay * previous if previous is not None else 0.0)
        length = min(chunk, numel)
        chunks = math.ceil(numel / length)
        magnitudes = torch.full((chunks * length,), -1.0, dtype=torch.float64)
        magnitudes[:numel] = acc.abs()
        top = magnitudes.view(chunks, length).topk(min(k, length), dim=1).indices
        positions = (top + torch.arange(chunks).unsqueeze(1) * length).reshape(-1)
        positions = positions[positions < numel]
        values = acc[positions]
        if bits is not None:
            levels = 2 ** bits
            std, mean = torch.std_mean(values, correction=0)
            step = std * 6.0 / levels
            codes = ((values - mean) / step + levels // 2).round().clamp(0, levels - 1).long()
            lookup = torch.zeros(levels, dtype=torch.float64).index_add_(0, codes, values)
            counts = torch.zeros(levels, dtype=torch.float64).index_add_(0, codes, torch.ones_like(values))
            values = (lookup / counts.clamp(min=1))[codes]
        sent = torch.zeros(numel, dtype=torch.float64).index_add_(0, positions, values)
        new_accumulators.append(acc - sent)
        total += sent
        chosen.index_add_(0, positions, torch.ones_like(values))
    return total / chosen.clamp(min=1), new_accumulators


@pytest.mark.parametrize("bits", [None, 2])
@pytest.mark.parametrize("numel", [4096 * 3, 5000])  # whole chunks, and a padded last chunk
def test_two_workers_match_the_float64_reference_over_several_steps(bits, numel: int) -> None:
    compressor = SparseLoCo(chunk=1024, k=16, bits=bits, decay=0.95)
    exchange = SimulatedExchange(compressor, 2, min_compress_numel=0)
    accumulators: list = [None, None]
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        inputs = [torch.randn(numel, generator=generator) * (1 + w) for w in range(2)]
        expected, accumulators = _reference_step(inputs, accumulators, 1024, 16, bits, 0.95)
        for worker in range(2):
            exchange.add_worker(worker, [("w", inputs[worker].clone())])
        aggregate = exchange.finish_step()["w"].double()
        matched = torch.isclose(aggregate, expected, rtol=1e-5, atol=1e-6).double().mean().item()
        assert matched >= (1.0 if bits is None else 0.99), (step, matched)  # 2 bits: fp32 vs fp64 bin edges
        for worker in range(2):
            state = exchange.pipelines[worker].memory.states["w"][ACCUMULATOR].double()
            close = torch.isclose(state, accumulators[worker], rtol=1e-5, atol=1e-5).double().mean().item()
            assert close >= (1.0 if bits is None else 0.99), (step, worker, close)
            accumulators[worker] = state  # go on from the package's state, so bin-edge cases do not compound


def test_bytes_handed_to_the_collective_are_twelve_bit_indices_and_two_bit_values() -> None:
    compressor = SparseLoCo()  # 64 of 4096, 12-bit indices, 2-bit values
    numel = 4096 * 50
    exchange = SimulatedExchange(compressor, 2, min_compress_numel=0)
    for worker in range(2):
        exchange.add_worker(worker, [("w", torch.randn(numel))])
    exchange.finish_step()
    count = 64 * 50
    payload = packed_nbytes(count, 12) + packed_nbytes(count, 2) + 4 * 4
    assert count * 12 // 8 == packed_nbytes(count, 12)
    assert compressor.payload_nbytes(numel, count) == payload
    flag = 4  # the bucket's verdict flag rides with the gather, whose buffer is padded to 8 bytes
    assert exchange.step_stats.bytes_sent == -(-(payload + flag) // 8) * 8
    assert numel * 4 / payload > 145  # about 146x fewer bytes than fp32


def test_padding_is_never_chosen_and_never_written() -> None:
    compressor = SparseLoCo(chunk=100, k=10, bits=None)
    exchange = SimulatedExchange(compressor, 1, min_compress_numel=0)
    x = torch.arange(1, 106, dtype=torch.float32)  # the last chunk holds 5 real entries, k = 10
    exchange.add_worker(0, [("w", x.clone())])
    aggregate = exchange.finish_step()["w"]
    assert aggregate.numel() == 105
    sent = aggregate.ne(0)
    assert sent[100:].all() and sent[:100].sum() == 10 and sent[90:100].all()
    torch.testing.assert_close(aggregate[sent], x[sent])


def test_decay_zero_keeps_only_what_this_step_did_not_send() -> None:
    compressor = SparseLoCo(chunk=64, k=8, bits=None, decay=0.0)
    exchange = SimulatedExchange(compressor, 1, min_compress_numel=0)
    for step in range(2):
        x = torch.randn(256)
        exchange.add_worker(0, [("w", x.clone())])
        aggregate = exchange.finish_step()["w"]
        accumulator = exchange.pipelines[0].memory.states["w"][ACCUMULATOR]
        torch.testing.assert_close(accumulator + aggregate, x)


def test_aggregate_all_divides_by_every_worker() -> None:
    x = [torch.randn(512), torch.randn(512)]
    results = {}
    for aggregate in ("chosen", "all"):
        exchange = SimulatedExchange(SparseLoCo(chunk=128, k=4, bits=None, aggregate=aggregate), 2,
                                     min_compress_numel=0)
        for worker in range(2):
            exchange.add_worker(worker, [("w", x[worker].clone())])
        results[aggregate] = exchange.finish_step()["w"]
    only_one = (results["all"] != 0) & (results["chosen"] != 0)
    ratio = results["chosen"][only_one] / results["all"][only_one]
    assert set(ratio.round().tolist()) <= {1.0, 2.0} and 2.0 in ratio.round().tolist()


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk": 1}, "`chunk` must be an integer >= 2"),
    ({"k": 0}, "`k` must be an integer >= 1"),
    ({"chunk": 64, "k": 65}, "`k` must be at most `chunk`"),
    ({"bits": 9}, r"`bits` must be an integer in \[1, 8\]"),
    ({"decay": 1.5}, r"`decay` must be a number in \[0, 1\]"),
    ({"aggregate": "sum"}, "`aggregate` must be 'chosen' or 'all'"),
])
def test_bad_arguments_name_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseLoCo(**kwargs)


def test_the_sparseloco_recipe_trains_end_to_end(tmp_path: Path) -> None:
    """The recipe (15 local steps per synchronisation, SparseLoCo's outer gradients, outer SGD lr 1) through
    the CLI, on one process to keep the suite short (the 2-process runs are in tests/test_local_updates.py)."""
    output = _run_cli(["fit", "--config", str(ROOT / "recipes/digits_sparseloco.yaml"), "--trainer.max_steps=45",
                       "--trainer.devices=1", "--trainer.logger=false"], tmp_path)
    assert "3 synchronisations in 45 optimizer steps" in output, output[-2000:]


#: a bucket (in the bucket's order, by name) whose chunks are not a view of it: tensors of chunk length 64
#: (k = 8) around one of its own length (``c``, 40 elements); ``a``'s and ``d``'s last chunks hold fewer than
#: k real entries (padding is chosen), and ``d`` ends the bucket (a chosen padding entry's position would lie
#: past its end); ``b`` fills whole chunks. The non-finite gradient is in ``a``, just before ``b``.
SHORT_CHUNKS = {"a": (3 * 64 + 5,), "b": (2, 64), "c": (40,), "d": (2 * 64 + 3,)}

#: whole chunks, one length: the chunks are a view of the bucket
WHOLE_CHUNKS = {"a": (4, 64), "b": (64,), "c": (2, 2, 64)}


def _exchange_steps(make, shapes: dict, bucket_wise: bool, steps: int = 4, workers: int = 3):
    """``steps`` steps of ``workers`` workers along the accelerator path, whole buckets or per tensor; at
    step 2 the first tensor of worker 1 holds a NaN (a bucket voided, each tensor's state kept or not by
    its own flag)."""
    exchange = SimulatedExchange(make(), workers=workers, min_compress_numel=0)
    for engine in exchange.engines:
        engine.segmented = bucket_wise
    results = []
    with accelerator_path():
        for step in range(steps):
            for worker in range(workers):
                generator = torch.Generator().manual_seed(1000 * step + worker)
                grads = [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]
                if step == 2 and worker == 1:
                    grads[0][1].view(-1)[3] = float("nan")
                exchange.add_worker(worker, grads)
            with pytest.warns(RuntimeWarning, match="non-finite") if step == 2 else contextlib.nullcontext():
                results.append(exchange.finish_step())
    return exchange, results


@pytest.mark.parametrize("shapes", [SHORT_CHUNKS, WHOLE_CHUNKS], ids=["short-chunks", "whole-chunks"])
@pytest.mark.parametrize("kwargs", [{"bits": 2}, {"bits": None}, {"bits": 3, "aggregate": "all"},
                                    {"bits": None, "aggregate": "all"}, {"bits": 2, "feedback": True}],
                         ids=["2-bit", "values", "3-bit-all", "values-all", "2-bit-feedback"])
def test_a_whole_bucket_equals_the_per_tensor_path_bit_for_bit(shapes: dict, kwargs: dict) -> None:
    """The bucket-wise exchange (chunks read as rows of a view or of one ``cat``, positions from each
    chunk's start, nothing kept per element) against the per-tensor one: results, accumulators and
    residuals equal, through chosen padding and a non-finite gradient."""
    kwargs = dict(kwargs)
    feedback = kwargs.pop("feedback", False)

    def make() -> SparseLoCo:
        compressor = SparseLoCo(chunk=64, k=8, **kwargs)
        compressor.default_error_feedback = feedback  # this instance only
        return compressor

    whole, actual = _exchange_steps(make, shapes, bucket_wise=True)
    single, expected = _exchange_steps(make, shapes, bucket_wise=False)
    for step, (want, got) in enumerate(zip(expected, actual)):
        for name in shapes:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True, msg=f"{step} {name}")
    for ours, theirs in zip(whole.pipelines, single.pipelines):
        assert ours.memory.residuals.keys() == theirs.memory.residuals.keys()
        for name, residual in theirs.memory.residuals.items():
            assert torch.equal(ours.memory.residuals[name], residual), name
        for name in shapes:
            assert torch.equal(ours.memory.states[name][ACCUMULATOR], theirs.memory.states[name][ACCUMULATOR]), name


def test_a_bucket_keeps_a_few_bytes_per_chunk_not_per_element() -> None:
    """The bucket-wise plan keeps per chunk its start, its member and its member's first lookup key (and
    where padding may be chosen, its real entries): 12 to 16 bytes per 4096 elements, and the longest padding
    once; a commit of per-tensor flags spreads them over one row per tensor of equal sizes."""
    shapes = ((1000, 1001),) * 3 + ((4096,), (5000,))
    segments = Segments(tuple(f"w{index}" for index in range(len(shapes))), shapes, 1)
    plan = _ChunkGroups(SparseLoCo(), segments, torch.device("cpu"))
    chunks = sum(group.rows for group in plan.groups)
    kept = [tensor for group in plan.groups for tensor in vars(group).values() if isinstance(tensor, torch.Tensor)]
    assert sum(tensor.numel() * tensor.element_size() for tensor in kept) <= 16 * chunks + 8 * len(shapes)
    assert [group.length for group in plan.groups] == [4096]  # one group: padded, read by one cat
    assert segments.coarse_rows.align == math.gcd(*segments.numels) and segments.coarse_rows.starts == segments.starts
    equal = Segments(("a", "b"), ((1000, 1001), (1000, 1001)), 1)
    assert equal.coarse_rows.rows == 2
