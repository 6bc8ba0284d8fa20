"""The worked example of docs/adding-a-compressor.md runs as written, through the conformance checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS, get_compressor
from lightning_gradcomp.simulation import SimulatedExchange

DOC = Path(__file__).parents[1] / "docs" / "adding-a-compressor.md"


@pytest.fixture
def scaled_sign():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(blocks[1], str(DOC), "exec"), namespace)  # the complete example
    try:
        yield namespace["ScaledSign"]
    finally:
        COMPRESSORS.pop("scaled_sign", None)


def test_the_documented_example_registers_and_passes_the_conformance_checks(scaled_sign) -> None:
    import tests.test_conformance as conformance

    compressor = get_compressor("scaled_sign")
    assert isinstance(compressor, scaled_sign)
    for workers in (1, 2, 4):
        conformance.test_declared_wire_format_is_what_the_protocol_hands_over("scaled_sign", workers)
    conformance.test_error_feedback_invariant_and_a_world_of_one("scaled_sign")
    conformance.test_checkpoint_round_trip_continues_identically("scaled_sign")


def test_the_documented_example_sends_one_bit_per_element_and_averages_scaled_signs(scaled_sign) -> None:
    exchange = SimulatedExchange(scaled_sign(), workers=2, error_feedback=False, min_compress_numel=1)
    grads = [torch.randn(4096), torch.randn(4096)]
    for worker, grad in enumerate(grads):
        exchange.add_worker(worker, [("w", grad)])
    aggregate = exchange.finish_step()["w"]
    expected = sum(g.abs().mean() * g.sign() for g in grads) / 2
    torch.testing.assert_close(aggregate, expected)
    assert exchange.step_stats.bytes_sent == 8 + 4096 // 8  # scale (aligned to 8) + 1 bit per element
