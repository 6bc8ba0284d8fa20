"""On one GPU: every compressor on CUDA, the real hook on NCCL and on gloo with CUDA tensors, no host
synchronisation in the hook, flat memory, precisions, save and resume.

``python -m pytest -m cuda`` runs these (about 3 minutes on an H100); without a GPU they are skipped.
Several ranks share the one GPU on gloo; NCCL refuses two ranks on one GPU, so it runs at world size 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.core.tensors import index_sum_, row_scatter_sum_

from tests import _cuda_workers as workers
from tests._gloo_workers import check_real_equals_simulated
from tests.test_rank_agreement import EVERY, assert_identical, decode
from tests.test_segments import SEGMENTED, compare_paths

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NAMES = sorted(COMPRESSORS)
#: register_fsdp needs FSDPModule.set_reduce_scatter_unused_params (torch 2.14 has it; 2.11 does not) and
#: refuses an older torch with a message saying so (local updates on shards need neither hook method)
_fsdp_hooks = pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "FSDPModule") or not hasattr(
    torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_unused_params"),
    reason="compressed HSDP needs FSDPModule.set_reduce_scatter_unused_params (a newer torch)")
#: Compressors whose draws are per rank on the device's generator (QSGD's and TernGrad's rounding
#: noise): on CUDA they draw other numbers than on CPU, by design (each rank's noise is its own).
DEVICE_NOISE = {"qsgd", "terngrad"}


@pytest.mark.parametrize("name", NAMES)
def test_every_compressor_in_the_simulation_on_cuda_matches_cpu(name: str) -> None:
    """Deterministic compressors (shared Random-k indices and PowerSGD's first Q included: drawn on the
    CPU) give the CPU's aggregates up to float rounding; a rounding that lands on the other side of a
    quantisation step moves a few elements by one step, and error feedback carries such a difference
    into later steps."""
    cpu = workers.simulate(name, "cpu")
    gpu = workers.simulate(name, "cuda")
    for step, (expected, actual) in enumerate(zip(cpu, gpu)):
        for param, value in expected.items():
            assert torch.isfinite(actual[param]).all(), (name, step, param)
            if name in DEVICE_NOISE:
                continue
            close = torch.isclose(actual[param], value, rtol=1e-4, atol=1e-5).float().mean()
            assert close >= (0.995 if step == 0 else 0.98), (name, step, param, close)


@pytest.mark.parametrize("label,make", SEGMENTED, ids=[label for label, _ in SEGMENTED])
def test_the_whole_bucket_exchange_on_cuda_equals_the_per_tensor_protocols(label: str, make) -> None:
    """On a GPU every listed compressor compresses whole buckets (tests/test_segments.py checks the same
    along the accelerator path on the CPU)."""
    compare_paths(label, make, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sums_of_repeated_indices_are_the_same_bits_every_time_on_cuda(dtype: torch.dtype) -> None:
    """A million values into 64 coordinates (``index_add_``'s atomics would add them in another order each
    time), five times: the same bits, along rows too; and in fp32 with a few repeats per coordinate, the
    CPU's ``index_add_`` in order."""
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 64, (1_000_000,), generator=generator).cuda()
    values = torch.randn(1_000_000, generator=generator).to(dtype).cuda()
    within = index.view(1000, 1000) % 8  # each row's thousand values into 8 columns

    def sums() -> tuple[torch.Tensor, torch.Tensor]:
        flat = index_sum_(torch.zeros(64, dtype=dtype, device="cuda"), index, values, alpha=1 / 3)
        return flat, row_scatter_sum_(torch.zeros(1000, 8, dtype=dtype, device="cuda"), within, values.view(1000, 1000))

    first = sums()
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, sums()))
    few = torch.randint(0, 100_000, (200_000,), generator=generator)
    few_values = torch.randn(200_000, generator=generator)
    expected = torch.zeros(100_000).index_add_(0, few, few_values, alpha=1 / 3)
    got = index_sum_(torch.zeros(100_000, device="cuda"), few.cuda(), few_values.cuda(), alpha=1 / 3)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.filterwarnings("ignore:DeMo. parameter 'a.weight'")
@pytest.mark.parametrize("label,make", EVERY, ids=[label for label, _ in EVERY])
def test_every_rank_decodes_the_same_gradient_on_cuda(label: str, make) -> None:
    """Workers that choose mostly the same coordinates, decoded three times on the GPU: the same bits each
    time, as every rank of a DDP job must get (tests/test_rank_agreement.py emulates the GPU's atomic adds
    on the CPU)."""
    first = decode(make, segmented=True, device="cuda")
    for _ in range(2):
        assert_identical(first, decode(make, segmented=True, device="cuda"), label)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 2)])
def test_the_real_hook_on_cuda_equals_the_simulation(backend: str, world_size: int) -> None:
    """Every compressor, exchange thread on and off: the real hook's parameters equal the simulated
    exchange's on the same GPU, and the bytes counted equal the bytes handed to torch.distributed."""
    workers.run_on_gpu(check_real_equals_simulated, world_size, backend, NAMES, "cuda", 1e-5)


@pytest.mark.multiprocess
def test_four_gloo_ranks_with_cuda_tensors() -> None:
    workers.run_on_gpu(check_real_equals_simulated, 4, "gloo", ["topk", "powersgd", "int8", "threshold"], "cuda", 1e-5)


@pytest.mark.multiprocess
@_fsdp_hooks
def test_compressed_hsdp_on_nccl_has_no_host_synchronisation() -> None:
    """register_fsdp's hook on FSDP2's all-reduce stream (issue 37)."""
    workers.run_on_gpu(workers.check_compressed_hsdp_without_host_sync, 1, "nccl")


@pytest.mark.multiprocess
def test_sharded_local_updates_on_nccl_with_global_weights_on_the_gpu_or_the_host() -> None:
    """Local updates on FSDP2 shards (issue 38): θ_global on the GPU and in pinned host memory agree."""
    workers.run_on_gpu(workers.check_sharded_local_updates_on_nccl, 1, "nccl")


@pytest.mark.multiprocess
def test_no_host_synchronisation_in_the_hook_on_nccl() -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` around steps of every fixed-size compressor."""
    workers.run_on_gpu(workers.check_no_sync_in_the_hook, 1, "nccl")


@pytest.mark.multiprocess
def test_memory_stays_flat_over_2000_raw_hook_steps() -> None:
    workers.run_on_gpu(workers.check_flat_memory, 1, "nccl", 2000)


@pytest.mark.multiprocess
def test_a_checkpoint_on_nccl_is_gathered_on_the_host_and_resumes_exactly() -> None:
    workers.run_on_gpu(workers.check_nccl_checkpoint_gathers_on_the_host, 1, "nccl")


@pytest.mark.multiprocess
def test_lightning_precisions_save_and_resume_on_one_gpu(tmp_path: Path) -> None:
    """32-true, bf16-mixed, 16-mixed (a compressor without memory; Top-k's error feedback is refused),
    bf16-true (residuals in fp32); save and resume with the exchange thread and without: the resumed
    run equals the uninterrupted one bit for bit."""
    out = tmp_path / "results.json"
    script = Path(__file__).parent / "scripts" / "cuda_lightning.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads(out.read_text())
    for key in ("32-true", "32-true-hook", "bf16-mixed", "16-mixed", "bf16-true", "bf16-true-powersgd"):
        run = results[key]
        assert run["finite"] and run["steps"] == 48, (key, results)
        assert run["last_loss"] < 0.9 * run["first_loss"], (key, results)
    assert results["bf16-true"]["param_dtype"] == "torch.bfloat16"
    assert results["bf16-true"]["residual_dtypes"] == ["torch.float32"]
    assert results["bf16-true-powersgd"]["residual_dtypes"] == ["torch.float32"]
    assert "precision='16-mixed'" in results["16-mixed-topk-refused"]
    assert results["resume-thread"] and results["resume-hook"]


# ---------------------------------------------------------------- issue 40: streams, threads, communicators
@pytest.mark.multiprocess
def test_overlapped_exchanges_survive_the_default_streams_allocations() -> None:
    workers.run_on_gpu(workers.check_overlapped_exchange_while_the_default_stream_allocates, 1, "nccl")


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_no_rank_creates_a_context_on_another_ranks_gpu() -> None:
    workers.run_one_gpu_per_rank(workers.check_no_context_on_another_ranks_gpu, 2)


@pytest.mark.multiprocess
def test_one_hardware_queue_keeps_the_exchange_in_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # inherited by the spawned process before CUDA starts
    workers.run_on_gpu(workers.check_one_hardware_queue, 1, "nccl")


@pytest.mark.parametrize("name", ["powersgd", "demo"])
def test_tf32_leaves_powersgd_and_demo_in_fp32_on_cuda(name: str) -> None:
    """``set_float32_matmul_precision("high")`` (TF32, as Lightning suggests on recent GPUs): the same
    results as ``"highest"`` bit for bit."""
    from lightning_gradcomp.exchange.simulated import SimulatedExchange

    def run(precision: str) -> list[torch.Tensor]:
        torch.set_float32_matmul_precision(precision)
        try:
            make = COMPRESSORS[name]
            exchange = SimulatedExchange(make(**({"decay": 0.95, "sign": False} if name == "demo" else {})), 2,
                                         min_compress_numel=100)
            generator = torch.Generator().manual_seed(3)
            results = []
            for _ in range(3):
                for worker in range(2):
                    exchange.add_worker(worker, [("a", torch.randn(256, 192, generator=generator).cuda()),
                                                 ("b", torch.randn(128, 128, generator=generator).cuda())])
                results += [t.cpu() for t in exchange.finish_step().values()]
            return results
        finally:
            torch.set_float32_matmul_precision("highest")

    assert all(torch.equal(a, b) for a, b in zip(run("highest"), run("high")))
