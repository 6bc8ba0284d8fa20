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
    example = next(block for block in blocks if "class ScaledSign" in block)  # the complete example
    exec(compile(example, str(DOC), "exec"), namespace)
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


def test_optional_capabilities_are_declared_and_checked_when_the_class_is_defined() -> None:
    """The engine takes an optional path by a class's declared ``capabilities``; overriding its method without
    declaring it (a path the engine would never take), declaring one without its method, or an unknown name
    is a TypeError naming the fix. The whole-bucket path is not inherited: a subclass declares it again."""
    from lightning_gradcomp.compressors import DeMo, NoCompression, TopK
    from lightning_gradcomp.compressors.base import BUCKET_CAPABILITIES, CAPABILITIES

    class Undeclared(NoCompression):
        pass

    class Redeclared(TopK):
        capabilities = TopK.capabilities

    with pytest.raises(TypeError, match=r"overrides finalize_dense without declaring the capability 'finalize_dense'"
                                        r".*capabilities = frozenset\(\{'finalize_dense'\}\)"):
        type("Sign", (NoCompression,), {"finalize_dense": lambda self, out, ctx: out.sign_()})
    with pytest.raises(TypeError, match="overrides exchange_segments without declaring the capability 'whole_bucket'"):
        type("Own", (NoCompression,), {"exchange_segments": NoCompression.exchange_segments})
    with pytest.raises(TypeError, match="declares the capability 'dense_segments' without implementing dense_segments"):
        type("Empty", (NoCompression,), {"capabilities": NoCompression.capabilities | {"dense_segments"}})
    with pytest.raises(TypeError, match=r"capabilities must be a frozenset of \['dense_segments'"):
        type("Odd", (NoCompression,), {"capabilities": frozenset({"fast"})})
    declared = type("Sign", (NoCompression,), {"finalize_dense": lambda self, out, ctx: out.sign_(),
                                               "capabilities": NoCompression.capabilities | {"finalize_dense"}})
    assert declared.capabilities == {"finalize_dense", "reads_flat_only", "whole_bucket"}
    assert Undeclared.capabilities == frozenset()  # the whole-bucket path is not inherited
    assert type("Variant", (DeMo,), {}).capabilities == {"finalize_dense"}  # the others are
    assert Redeclared.capabilities == {"whole_bucket"}
    assert all("whole_bucket" in c.capabilities for c in COMPRESSORS.values())
    assert BUCKET_CAPABILITIES < set(CAPABILITIES)
    assert all(c.capabilities <= set(CAPABILITIES) for c in COMPRESSORS.values())
    assert {name for name, c in COMPRESSORS.items() if "dense_segments" in c.capabilities} == \
        {"bf16", "demo", "dgc", "fp16"}


def test_a_variant_of_a_built_in_runs_its_own_per_tensor_methods_on_the_accelerator_path() -> None:
    """A subclass that changes a per-tensor method does not inherit the whole-bucket path (which reproduces
    its parent's methods, not its own): on the accelerator path its ``compress`` runs, once per tensor; the
    parent takes the whole bucket at once."""
    from lightning_gradcomp.compressors import TopK
    from lightning_gradcomp.core.device import accelerator_path

    calls: list[str] = []

    class Counted(TopK):
        def compress(self, tensor, ctx):
            calls.append(ctx.name)
            return super().compress(tensor, ctx)

    grads = [("a", torch.randn(4096)), ("b", torch.randn(8192))]
    with accelerator_path():
        for compressor in (TopK(0.01), Counted(0.01)):
            exchange = SimulatedExchange(compressor, workers=1, min_compress_numel=100)
            exchange.add_worker(0, grads)
            exchange.finish_step()
            assert ("whole_bucket" in type(compressor).capabilities) == (type(compressor) is TopK)
    assert calls == ["a", "b"]


def test_a_finalize_dense_that_the_inherited_many_would_bypass_is_refused() -> None:
    """DeMo's ``finalize_dense_many`` is one multi-tensor sign, not a loop over ``finalize_dense``: a subclass
    that overrides only ``finalize_dense`` would never see it called, so the class is refused when defined."""
    from lightning_gradcomp.compressors import DeMo

    with pytest.raises(TypeError, match="overrides finalize_dense, but the finalize_dense_many it inherits"):
        type("Halved", (DeMo,), {"finalize_dense": lambda self, out, ctx: out.mul_(0.5)})
    both = type("Halved", (DeMo,), {"finalize_dense": lambda self, out, ctx: out.mul_(0.5),
                                    "finalize_dense_many": lambda self, outs, contexts: None})
    assert "finalize_dense" in both.capabilities
