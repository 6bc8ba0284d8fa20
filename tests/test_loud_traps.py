"""Issue 36, items 4, 5 and 10: settings that trained something else without a word now say so.

* Gradient clipping after a compressor whose aggregate is signs (DeMo, ``SignSGD(scale="none")``): the
  Trainer's ``gradient_clip_val`` is refused (:func:`check_gradient_clipping`); on the plain path the
  handle checks and binds the optimizer (``bind``, or the first optimizer step), and DeMo warns at the
  first exchange when none is bound.
* fp16 ``GradScaler`` with error feedback on the plain path: warned once, when the scaler steps the model's
  optimizer.
* fp32 gradients beyond fp16's ±65504 through the ``fp16`` compressor: a non-finite bucket (NaN on every
  worker, memory unchanged) and a warning naming fp16's range, instead of inf sent silently.

Each test fails on the code before the change.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Callable

import pytest
import torch
from torch import nn

from lightning_gradcomp.compressors import COMPRESSORS, DeMo, EFSignSGD, SignSGD, TopK
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.simulation import SimulatedExchange
from tests._processes import run_gloo

# ---------------------------------------------------------------------------------------------- clipping


def _trainer(**options: object) -> object:
    from lightning import Trainer

    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **options)


def test_only_demo_and_bare_signsgd_hand_the_optimizer_signs() -> None:
    """The compressors whose aggregate is ±1 whatever the gradient say so; scaled signs and the rest do not."""
    signs = {name for name, cls in COMPRESSORS.items() if cls().produces_signs}
    assert signs == {"demo"}, signs
    assert SignSGD(scale="none").produces_signs and not SignSGD().produces_signs
    assert not DeMo(sign=False).produces_signs and not EFSignSGD().produces_signs


@pytest.mark.parametrize("compressor", [DeMo(), SignSGD(scale="none")], ids=["demo", "signsgd-none"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_the_trainers_gradient_clipping_after_signs_is_refused_with_what_to_do(compressor, algorithm: str) -> None:
    """Lightning clips what the exchange hands the optimizer: ±1s of norm √d, shrunk ~600x by a clip at 1
    (the issue's run stopped learning). Refused, naming the setting, the compressor and what to do."""
    from lightning_gradcomp.lightning.options import check_gradient_clipping

    trainer = _trainer(gradient_clip_val=1.0, gradient_clip_algorithm=algorithm)
    with pytest.raises(ValueError, match=rf"gradient_clip_val=1.0 \(gradient_clip_algorithm='{algorithm}'\) clips "
                                         rf"what {type(compressor).__name__}\(.*signs.*√d.*allowed: "
                                         r"gradient_clip_val=None \(or 0\)"):
        check_gradient_clipping(compressor, trainer)


def test_gradient_clipping_is_left_alone_where_it_means_something() -> None:
    """No clipping (None, 0), or a compressor whose aggregate keeps the gradients' size: nothing to say."""
    from lightning_gradcomp.lightning.options import check_gradient_clipping

    for clip in (None, 0, 0.0):
        check_gradient_clipping(DeMo(), _trainer(gradient_clip_val=clip))
    clipped = _trainer(gradient_clip_val=1.0)
    for compressor in (DeMo(sign=False), SignSGD(), EFSignSGD(), TopK(0.01), COMPRESSORS["qsgd"]()):
        check_gradient_clipping(compressor, clipped)


def test_the_same_refusal_serves_other_clipping_calls() -> None:
    """Fabric's ``clip_gradients`` (a call in the loop, not a Trainer option) gets the same words."""
    from lightning_gradcomp.lightning.options import check_clipping_after_signs

    with pytest.raises(ValueError, match=r"fabric.clip_gradients\(max_norm=1.0\) clips what DeMo\(.*allowed: no "
                                         r"fabric.clip_gradients with this compressor"):
        check_clipping_after_signs(DeMo(), "fabric.clip_gradients(max_norm=1.0)", "no fabric.clip_gradients")
    check_clipping_after_signs(SignSGD(), "fabric.clip_gradients(max_norm=1.0)", "no fabric.clip_gradients")


# ---------------------------------------------------------------------------------------------- fp16 overflow


def _overflowing(worker: int, step: int, where: str) -> list[tuple[str, torch.Tensor]]:
    """A compressed weight and a dense bias; on worker 1 at step 1 one element beyond fp16's range."""
    generator = torch.Generator().manual_seed(10 * step + worker)
    grads = [("a.weight", torch.randn(32, 40, generator=generator)), ("b.bias", torch.randn(24, generator=generator))]
    if worker == 1 and step == 1:
        grads[0 if where == "compressed" else 1][1].view(-1)[5] = 1e5  # finite in fp32, inf in fp16
    return grads


@pytest.mark.parametrize("path", ["per tensor", "bucket-wise"])
@pytest.mark.parametrize("where", ["compressed", "dense"])
def test_fp16_overflow_of_fp32_gradients_voids_the_bucket_and_warns(path: str, where: str) -> None:
    """Before: 1e5 became inf in the cast, the all-reduce sent inf to every worker and nothing was said
    (with error feedback the residual became -inf). Now the cast's finiteness is checked (on the bucket-wise
    path in one multi-tensor max-norm, no host read): the bucket is NaN on every worker, the residuals stay
    as they were, and the worker warns naming the parameter."""
    exchange = SimulatedExchange(COMPRESSORS["fp16"](), workers=2, error_feedback=True, min_compress_numel=100)
    with accelerator_path() if path == "bucket-wise" else nullcontext():
        for worker in range(2):
            exchange.add_worker(worker, _overflowing(worker, 0, where))
        exchange.finish_step()
        residuals = [{n: r.clone() for n, r in p.memory.residuals.items()} for p in exchange.pipelines]
        for worker in range(2):
            exchange.add_worker(worker, _overflowing(worker, 1, where))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            aggregate = exchange.finish_step()
    name = "a.weight" if where == "compressed" else "b.bias"
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1 and f"on rank 1 at step 2 in {name}" in messages[0], messages
    assert torch.isnan(aggregate[name]).all() and not torch.isinf(aggregate[name]).any()
    for before, pipeline in zip(residuals, exchange.pipelines):
        after = pipeline.memory.residuals
        assert all(torch.isfinite(value).all() for value in after.values())
        assert before and all(torch.equal(after[key], value) for key, value in before.items()), "a void step"


def test_fp16_keeps_the_accelerator_path_and_its_finite_values() -> None:
    """Judging the cast instead of the gradient changes nothing for values in range: the same aggregate on
    both paths as plain casts, and FP16 still takes the bucket-wise path on accelerators."""
    compressor = COMPRESSORS["fp16"]()
    assert compressor.segment_alignment(torch.device("cuda")) == 1 and compressor.checks_finite
    results = []
    for path in (nullcontext, accelerator_path):
        exchange = SimulatedExchange(compressor, workers=2, min_compress_numel=100)
        with path():
            for worker in range(2):
                exchange.add_worker(worker, _overflowing(worker, 0, "compressed"))
            results.append(exchange.finish_step())
    for name in results[0]:
        grads = [dict(_overflowing(worker, 0, ""))[name].reshape(-1) for worker in range(2)]
        expected = (grads[0].half() / 2 + grads[1].half() / 2).float()
        for result in results:
            torch.testing.assert_close(result[name], expected, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------- register()


@pytest.mark.multiprocess
def test_register_checks_and_binds_the_optimizer_and_warns_when_demo_runs_unbound() -> None:
    """Before: DeMo ran under AdamW with no word (its check was the user's to call)."""
    run_gloo(check_register_binds_the_optimizer, 1)


@pytest.mark.multiprocess
def test_register_warns_once_about_an_fp16_grad_scaler_with_error_feedback() -> None:
    """Before: residuals kept at a changing loss scale with no word (the strategies refuse '16-mixed')."""
    run_gloo(check_register_warns_about_grad_scaler, 1)


@pytest.mark.multiprocess
def test_register_with_fp16_warns_about_gradients_beyond_its_range() -> None:
    """Before: fp32 gradients beyond ±65504 became inf on every rank with no word."""
    run_gloo(check_register_warns_about_fp16_overflow, 1)


def _ddp() -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))


def _backward(ddp: nn.Module, scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
              factor: float = 1.0) -> None:
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    scale(nn.functional.cross_entropy(ddp(x), y) * factor).backward()


def _caught(action: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if "gradcomp" in str(w.message)]


def check_register_binds_the_optimizer(rank: int, world_size: int) -> None:
    import lightning_gradcomp

    # DeMo under AdamW, nothing bound: a warning at the first exchange, a refusal at the first step
    ddp = _ddp()
    handle = lightning_gradcomp.register(ddp, DeMo(), min_compress_numel=16)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    messages = _caught(lambda: _backward(ddp))
    assert len(messages) == 1 and "no optimizer is bound" in messages[0] and "gradcomp.bind(optimizer)" in messages[0]
    with pytest.raises(ValueError, match="DeMo holds the momentum and steps along a sign, but AdamW keeps moments"):
        adamw.step()
    assert not _caught(lambda: _backward(ddp)), "warned once"
    with pytest.raises(ValueError, match="AdamW keeps moments"):
        adamw.step()  # still refused
    with pytest.raises(ValueError, match="`optimizer` must be a torch.optim.Optimizer"):
        handle.bind(ddp)
    other = nn.Linear(3, 2)  # another model's optimizer is none of this handle's business
    other(torch.randn(4, 3)).sum().backward()
    torch.optim.AdamW(other.parameters()).step()
    handle.close()

    # the optimizers bound are checked against a compressor switched to (and the switch refused on a conflict)
    ddp = _ddp()
    handle = lightning_gradcomp.register(ddp, TopK(0.1), min_compress_numel=16)
    momentum = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    handle.bind(momentum)
    with pytest.raises(ValueError, match="DeMo holds the momentum, but SGD applies momentum=0.9"):
        handle.use_compressor(DeMo())
    assert isinstance(handle.hook_state.compressor, TopK)
    handle.close()

    # DeMo bound to SGD first: no warning, and DeMo reads that optimizer's learning rate
    ddp = _ddp()
    compressor = DeMo()
    handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=16)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    handle.bind(sgd)
    assert compressor._learning_rate() == 0.05
    with pytest.raises(ValueError, match="AdamW keeps moments"):
        handle.bind(torch.optim.AdamW(ddp.parameters()))

    def train() -> None:
        for _ in range(2):
            _backward(ddp)
            sgd.step()
            sgd.zero_grad()

    assert not _caught(train)
    handle.close()


def check_register_warns_about_grad_scaler(rank: int, world_size: int) -> None:
    import lightning_gradcomp

    # Top-k with error feedback under an fp16 GradScaler: one warning, at its first step
    ddp = _ddp()
    handle = lightning_gradcomp.register(ddp, TopK(0.1), min_compress_numel=16)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()

    def scaled_steps() -> None:
        for _ in range(3):
            _backward(ddp, scaler.scale)
            scaler.step(sgd)
            scaler.update()
            sgd.zero_grad()

    messages = _caught(scaled_steps)
    assert len(messages) == 1, messages
    assert "GradScaler steps the optimizer" in messages[0] and "error feedback" in messages[0]
    assert "bf16" in messages[0] and "error_feedback=False" in messages[0]
    handle.close()

    # ... nothing where the exchange keeps no memory (QSGD: unbiased, no error feedback), or the scaler is disabled
    for compressor, error_feedback, enabled in [("qsgd", None, True), ("topk", None, False)]:
        ddp = _ddp()
        handle = lightning_gradcomp.register(ddp, compressor, error_feedback=error_feedback, min_compress_numel=16)
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        assert not _caught(scaled_steps), (compressor, enabled)
        handle.close()


def check_register_warns_about_fp16_overflow(rank: int, world_size: int) -> None:
    import lightning_gradcomp

    # fp16 of fp32 gradients beyond ±65504: the non-finite warning, and once why, naming bf16
    ddp = _ddp()
    handle = lightning_gradcomp.register(ddp, "fp16", min_compress_numel=16)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def overflow() -> None:
        for _ in range(2):
            _backward(ddp, factor=1e7)
            handle.step_stats  # closes the step: its warnings come out
            sgd.zero_grad()

    messages = _caught(overflow)
    assert sum("non-finite gradient (NaN or Inf)" in m for m in messages) == 2, messages
    hints = [m for m in messages if "±65504" in m]
    assert len(hints) == 1 and "'bf16'" in hints[0], messages
    handle.close()


@pytest.mark.parametrize("compressor", [DeMo(), SignSGD(scale="none")], ids=["demo", "signsgd-none"])
def test_the_simulation_strategy_refuses_gradient_clipping_after_signs_before_the_first_step(compressor) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradcomp import GradCompSimStrategy
    from tests.test_bad_inputs import _Tiny

    model = _Tiny()
    data = DataLoader(TensorDataset(torch.randn(16, 40)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=GradCompSimStrategy(workers=2, compressor=compressor),
                        max_epochs=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ValueError, match=rf"gradient_clip_val=1.0 .* clips what {type(compressor).__name__}\("):
        trainer.fit(model, data)
    assert model.steps == 0, "refused before the first step"
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=GradCompSimStrategy(workers=2, compressor=compressor),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, data)  # no clipping: fine
    assert model.steps > 0


@pytest.mark.multiprocess
def test_register_state_dict_on_rank_0_alone_raises_with_advice_instead_of_hanging() -> None:
    """Issue 36, item 3, for ``register()``: before, ``state_dict()`` inside ``if rank == 0:`` hung forever."""
    run_gloo(check_register_rank_0_only_state_dict, 2)


def check_register_rank_0_only_state_dict(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from lightning_gradcomp import register
    from lightning_gradcomp.exchange.checkpoint import CheckpointTimeout

    with pytest.raises(ValueError, match="`timeout` must be a positive timedelta"):
        register(_ddp(), "topk", timeout=0)
    ddp = _ddp()
    handle = register(ddp, "topk", timeout=1.0)
    _backward(ddp)
    if rank == 0:
        with pytest.raises(CheckpointTimeout, match=r"waited 1 s for the other ranks .* call it on every rank first"):
            handle.state_dict()
    dist.barrier()
    handle.close()
    ddp = _ddp()
    handle = register(ddp, "topk")
    _backward(ddp)
    entry = handle.state_dict()  # every rank: the entry on rank 0
    assert (entry is not None) == (rank == 0)
    handle.close()
