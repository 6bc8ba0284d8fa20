"""The conformance suite: every registered compressor against the engine's contract.

A new compressor joins by registering (a ``name``): it is picked up from ``COMPRESSORS``. Checked here,
in process: the declared wire format equals what its protocol hands over, round by round; the declared
count is honest (a wrong declaration is an error, not garbage); error feedback's invariant
``C(p) + e_{t+1} == p``; the aggregate of 2 and 3 workers equals an independent oracle (each worker's
own decoded contribution, averaged; tests/_oracle.py), whatever order the parameters are listed in; the
simulation's checkpoint round trip. Checked with real processes (tests/_gloo_workers.py): the real driver's result and bytes equal the
simulated driver's for every compressor.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS, CompressContext, Compressor, Payload, TopK
from lightning_gradcomp.core.protocol import AllToAll, Mean, Outcome, Received
from lightning_gradcomp.simulation import SimulatedExchange

from tests._gloo_workers import conformance_settings
from tests._oracle import expected_aggregate
from tests._processes import run_gloo

NAMES = sorted(COMPRESSORS)
SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "fc.bias": (40,)}


def make(name: str) -> Compressor:
    return COMPRESSORS[name](**conformance_settings().get(name, {}))


def grads(worker: int, step: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 * step + worker)
    return [(name, torch.randn(shape, generator=generator, dtype=dtype)) for name, shape in SHAPES.items()]


def drive_alone(compressor: Compressor, tensor: torch.Tensor, ctx: CompressContext) -> tuple[list[list], Outcome]:
    """Run one tensor's protocol as worker ``ctx.rank`` of ``ctx.world_size`` whose peers send what it
    sends (a world of one by default); return the requests of each round."""
    peers = ctx.world_size
    protocol = compressor.exchange(tensor, ctx)
    rounds, results = [], None
    while True:
        try:
            turn = protocol.send(results)
        except StopIteration as stop:
            return rounds, stop.value
        rounds.append(list(turn.requests))
        results = [request.tensor if isinstance(request, Mean) else
                   [Received(request.parts[ctx.rank], None)] * peers if isinstance(request, AllToAll) else
                   [Received(request.parts, request.count)] * peers for request in turn.requests]


def _parts(request) -> list[torch.Tensor]:
    """The tensors a request hands over, in the order of ``wire_format`` (all-to-all: by destination)."""
    if isinstance(request, Mean):
        return [request.tensor]
    if isinstance(request, AllToAll):
        return [part for destination in request.parts for part in destination]
    return list(request.parts)


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_declared_wire_format_is_what_the_protocol_hands_over(name: str, workers: int) -> None:
    compressor = make(name)
    for param, shape in SHAPES.items():
        tensor = torch.randn(shape).reshape(-1)
        ctx = CompressContext(param, step=0, rank=workers - 1, world_size=workers, shape=shape)
        rounds, outcome = drive_alone(compressor, tensor, ctx)
        handed = [[(part.dtype, part.numel()) for request in requests for part in _parts(request)]
                  for requests in rounds]
        declared = compressor.wire_format(shape, tensor.dtype, outcome.count, world_size=workers)
        assert handed == declared, (param, handed)


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_invariant_and_a_world_of_one(name: str) -> None:
    """One worker: the aggregate is what was sent, so ``aggregate + e_{t+1} == g_t + e_t`` (a world-size-1
    round trip of every compressor, with error feedback forced on)."""
    compressor = make(name)
    feedback = None if compressor.owns_residual else True
    exchange = SimulatedExchange(compressor, workers=1, error_feedback=feedback, min_compress_numel=100)
    previous = {param: torch.zeros(shape).reshape(-1) for param, shape in SHAPES.items()}
    for step in range(3):
        worker_grads = grads(0, step)
        exchange.add_worker(0, worker_grads)
        aggregate = exchange.finish_step()
        memory = exchange.pipelines[0].memory
        for param, grad in worker_grads:
            if compressor.owns_residual or grad.numel() < 100:
                continue
            p = grad.reshape(-1) + previous[param]
            residual = memory.residuals[param]
            # exact for sparsifiers (tests/test_memory_and_wire.py); one rounding of p - C(p) otherwise
            torch.testing.assert_close(aggregate[param] + residual, p)
            previous[param] = residual.clone()


def _assert_matches_oracle(name: str, aggregate: dict, expected: dict, where: str) -> None:
    """Every element within float rounding of the oracle; the quantisers may move a few elements by one
    quantisation step where a rounding lands on the other side of a level (the engine sums in another
    order than the oracle)."""
    for param, value in expected.items():
        close = torch.isclose(aggregate[param].double(), value.double(), rtol=1e-4, atol=1e-6)
        share = float(close.double().mean())
        assert share >= (0.99 if name in ("int4", "int8", "fp8", "qsgd", "terngrad") else 1.0), (
            f"{name} {where} {param}: {share:.4f} of the elements match the oracle, largest difference "
            f"{float((aggregate[param].double() - value.double()).abs().max()):.3g}")


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_the_aggregate_is_the_mean_of_each_workers_own_decoded_contribution(name: str, workers: int) -> None:
    """The engine's result equals an independent oracle (tests/_oracle.py): each worker's own compression
    of its own input, decoded and averaged (or the method's own aggregation, written out), over three
    steps with every worker's memory carried along."""
    exchange = SimulatedExchange(make(name), workers, min_compress_numel=100)
    for step in range(3):
        named = [grads(worker, step) for worker in range(workers)]
        expected = expected_aggregate(exchange, named, SHAPES)
        for worker in range(workers):
            exchange.add_worker(worker, named[worker])
        _assert_matches_oracle(name, exchange.finish_step(), expected, f"step {step}")


@pytest.mark.parametrize("name", NAMES)
def test_the_layout_does_not_depend_on_the_order_parameters_are_listed_in(name: str) -> None:
    """Worker 1 lists the bucket's parameters in the reverse order of worker 0 (a simulation's model
    against a real DDP bucket): the exchange sorts them, so the result is still the oracle's."""
    exchange = SimulatedExchange(make(name), 2, min_compress_numel=100)
    for step in range(2):
        named = [grads(worker, step) for worker in range(2)]
        expected = expected_aggregate(exchange, named, SHAPES)
        exchange.add_worker(0, named[0])
        exchange.add_worker(1, list(reversed(named[1])))
        _assert_matches_oracle(name, exchange.finish_step(), expected, f"step {step}, reversed")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_continues_identically(name: str) -> None:
    def run(exchange: SimulatedExchange, steps: range) -> list[dict[str, torch.Tensor]]:
        out = []
        for step in steps:
            for worker in range(2):
                exchange.add_worker(worker, grads(worker, step))
            out.append(exchange.finish_step())
        return out

    whole = SimulatedExchange(make(name), workers=2, min_compress_numel=100)
    run(whole, range(3))
    states = whole.state_dicts()
    tail = run(whole, range(3, 5))
    restored = SimulatedExchange(make(name), workers=2, min_compress_numel=100)
    restored.load_state_dicts(states, torch.device("cpu"))
    for expected, actual in zip(tail, run(restored, range(3, 5))):
        for param in expected:
            assert torch.equal(expected[param], actual[param]), (name, param)


class LyingTopK(TopK):
    """Declares one coordinate more than it sends."""

    name = ""  # not registered

    def static_count(self, numel: int) -> int:
        return super().static_count(numel) + 1


def test_a_wrong_static_count_is_a_clear_error() -> None:
    exchange = SimulatedExchange(LyingTopK(0.01), workers=2, min_compress_numel=10)
    with pytest.raises(ValueError, match=r"LyingTopK.compress returned 12 coordinates for parameter 'conv.weight' "
                                         r"of 1152, but static_count\(1152\) declares 13"):
        exchange.add_worker(0, grads(0, 0))


def test_parts_that_differ_from_the_declaration_are_a_clear_error() -> None:
    class ShortParts(TopK):
        name = ""

        def compress(self, tensor, ctx):
            payload = super().compress(tensor, ctx)
            return Payload((payload.parts[0], payload.parts[1].long()), payload.numel, payload.count)

    with pytest.raises(ValueError, match="ShortParts.compress returned parts .*torch.int64.* but part_dtypes"):
        SimulatedExchange(ShortParts(0.01), workers=1, min_compress_numel=10).add_worker(0, grads(0, 0))


@pytest.mark.multiprocess
def test_real_driver_equals_simulated_driver_for_every_compressor() -> None:
    """2 real gloo processes train a small DDP model with each compressor; each rank also runs the
    2-worker simulation on the same data: parameters within 1e-5 and bytes exactly equal."""
    from tests._gloo_workers import check_real_equals_simulated

    run_gloo(check_real_equals_simulated, 2, NAMES)


#: bit-packing compressors at every code width they take: the payload of each tensor must survive the
#: compression of the bucket's next tensors (8-bit codes are their own packing, and must not alias memory
#: the compressor reuses)
CODE_WIDTHS = [("qsgd", {"bits": bits}) for bits in range(2, 11)] + \
              [("sparseloco", {"bits": bits}) for bits in (1, 2, 4, 8)]


@pytest.mark.parametrize("name, settings", CODE_WIDTHS, ids=[f"{n}-{s}" for n, s in CODE_WIDTHS])
def test_the_aggregate_matches_the_oracle_at_every_code_width(name: str, settings: dict) -> None:
    exchange = SimulatedExchange(COMPRESSORS[name](**settings), 2, min_compress_numel=100)
    for step in range(2):
        named = [grads(worker, step) for worker in range(2)]
        expected = expected_aggregate(exchange, named, SHAPES)
        for worker in range(2):
            exchange.add_worker(worker, named[worker])
        _assert_matches_oracle(name, exchange.finish_step(), expected, f"step {step}, {settings}")
