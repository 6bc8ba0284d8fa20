"""16-bit parameters and loss scaling: residuals and state in fp32, what the fp16 guard refuses."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.compressors import DGC, FP16, FP8AllReduce, Int8AllReduce, PowerSGD, SignSGD, TopK
from lightning_gradcomp.lightning.options import check_fit_setup
from lightning_gradcomp.simulation import GradCompSimStrategy, SimulatedExchange


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 8), (torch.float16, 11)])
def test_error_feedback_delivers_the_sum_of_small_gradients_with_16_bit_parameters(dtype: torch.dtype,
                                                                                  bits: int) -> None:
    """A coordinate of gradient ``2^-(bits+2)`` always loses Top-k against one of magnitude 1: its
    gradients pile up in the residual until they pass 1 and win. Delivered plus residual equals the sum
    of the gradients (fp32 residuals). In a 16-bit residual of ``bits`` significant bits the sum would
    stop growing at 1/4, where each addition is half a unit in the last place, and never be sent."""
    exchange = SimulatedExchange(TopK(density=0.5), workers=1, error_feedback=True, min_compress_numel=1)
    small = 2.0 ** -(bits + 2)
    steps = 2 ** (bits + 2) + 64
    delivered = torch.zeros(2, dtype=torch.float64)
    for step in range(steps):
        grad = torch.tensor([1.0 if step % 2 else -1.0, small], dtype=dtype)  # the first always wins
        exchange.add_worker(0, [("w", grad)])
        delivered += exchange.finish_step()["w"].double()
    residual = exchange.pipelines[0].memory.residuals["w"]
    assert residual.dtype == torch.float32
    assert torch.equal(delivered + residual.double(), torch.tensor([0.0, steps * small], dtype=torch.float64))
    assert delivered[1] > 0, "the small coordinate's sum won and was delivered"


def test_payloads_keep_the_gradient_dtype_on_the_wire() -> None:
    """With fp32 residuals, what crosses the wire is still in the gradient's dtype (bytes as declared)."""
    exchange = SimulatedExchange(TopK(density=0.01), workers=2, error_feedback=True, min_compress_numel=100)
    for worker in range(2):
        exchange.add_worker(worker, [("w", torch.randn(100, 100, dtype=torch.bfloat16))])
    out = exchange.finish_step()["w"]
    assert out.dtype == torch.bfloat16
    # 100 values in bf16 (200 bytes) and 100 int32 indices, the finiteness flag, aligned to 8
    assert exchange.step_stats.bytes_sent == 200 + 400 + 8


def test_a_bf16_true_run_keeps_every_state_in_fp32() -> None:
    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size=32)
    for compressor in (TopK(0.1), PowerSGD(rank=2), DGC(0.1)):
        model = Model()
        strategy = GradCompSimStrategy(workers=2, compressor=compressor, min_compress_numel=100, print_summary=False)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true", max_epochs=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model, data)
        assert next(model.parameters()).dtype == torch.bfloat16
        memories = [pipeline.memory for pipeline in strategy.hook_state.pipelines]
        tensors = [t for memory in memories for t in memory.residuals.values()]
        tensors += [t for memory in memories for state in memory.states.values() for t in state.values()]
        assert tensors and all(t.dtype == torch.float32 for t in tensors), (compressor, {t.dtype for t in tensors})


def test_fp16_loss_scaling_is_refused_for_every_compressor_state_kept_across_steps() -> None:
    scaled = SimpleNamespace(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"SignSGD's memory \(the state it keeps across steps\)"):
        check_fit_setup(SignSGD(momentum=0.9), False, [], scaled)  # Signum's momentum
    with pytest.raises(ValueError, match=r"Int8AllReduce's memory \(the state it keeps across steps\)"):
        check_fit_setup(Int8AllReduce(), False, [], scaled)  # the owner residual
    check_fit_setup(SignSGD(), False, [], scaled)  # plain signSGD keeps nothing
    check_fit_setup(FP8AllReduce(owner_error_feedback=False), False, [], scaled)


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "int8", "fp8", "topk", "powersgd"])
def test_fp64_gradients_are_exchanged_on_both_paths(name: str) -> None:
    """fp64 gradients (a model in double precision) on the CPU's per-tensor path and the accelerator's
    whole-bucket path: fp64 results that agree to the wire's fp32 rounding (SignSGD's per-tensor scale
    failed on fp64 before: the norm's fp32 ``dtype`` may not narrow a double tensor)."""
    from lightning_gradcomp.compressors import COMPRESSORS
    from lightning_gradcomp.core.device import accelerator_path

    grads = [torch.randn(64, 80, dtype=torch.float64, generator=torch.Generator().manual_seed(w)) for w in range(2)]
    results = []
    for accelerator in (False, True):
        exchange = SimulatedExchange(COMPRESSORS[name](), workers=2)
        with accelerator_path() if accelerator else torch.no_grad():
            for step in range(2):
                for worker in range(2):
                    exchange.add_worker(worker, [("w", grads[worker] * (step + 1))])
                results.append(exchange.finish_step()["w"])
    assert all(result.dtype == torch.float64 and bool(result.isfinite().all()) for result in results)
    assert torch.allclose(results[1], results[3], rtol=1e-5, atol=1e-6)


def test_fp16_refuses_bfloat16_gradients_before_compressing() -> None:
    """A bf16 gradient cast to fp16 saves no bytes and overflows beyond ±65504: refused, naming what to use."""
    exchange = SimulatedExchange(FP16(), workers=2)
    with pytest.raises(ValueError, match=r"'fp16' on bfloat16 gradients.*allowed for bfloat16 gradients: 'bf16'"):
        exchange.add_worker(0, [("w", torch.full((2048,), 1e5, dtype=torch.bfloat16))])
