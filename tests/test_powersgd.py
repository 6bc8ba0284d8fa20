"""PowerSGD against a direct float64 implementation of Vogels et al. (NeurIPS 2019, Alg. 1), and in real
2-process Lightning runs."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import CompressContext, PowerSGD
from lightning_gradcomp.simulation import SimulatedExchange

SHAPES = {"conv.weight": (8, 4, 3, 3), "fc.weight": (20, 30), "tiny.weight": (3, 3), "fc.bias": (20,)}
WORKERS, RANK, STEPS = 2, 2, 5


def _grads(worker: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(31 * step + worker)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64) for name, shape in SHAPES.items()}


def _reference(warm_start: bool, start_step: int) -> list[dict[str, torch.Tensor]]:
    """The algorithm written out: M = G + E; P = mean(M Q); P^ = orth(P); Q = mean(M^T P^); U = P^ Q^T;
    E = M - U. Small or 1-D tensors, and steps before start_step: plain averages."""
    residuals = {(w, n): torch.zeros(s, dtype=torch.float64).reshape(s[0], -1) for w in range(WORKERS)
                 for n, s in SHAPES.items()}
    q_state: dict[str, torch.Tensor] = {}
    updates = []
    for step in range(STEPS):
        grads = [_grads(w, step) for w in range(WORKERS)]
        update = {}
        for name, shape in SHAPES.items():
            if len(shape) == 1 or name == "tiny.weight" or step < start_step:
                update[name] = sum(g[name] for g in grads).reshape(-1) / WORKERS
                continue
            m_local = [grads[w][name].reshape(shape[0], -1) + residuals[(w, name)] for w in range(WORKERS)]
            q = q_state.get(name) if warm_start else None
            if q is None:
                generator = CompressContext(name, step=step, seed=0).generator(torch.device("cpu"), per_rank=False)
                q = torch.randn(m_local[0].shape[1], RANK, generator=generator, dtype=torch.float64)
            p = sum(m @ q for m in m_local) / WORKERS
            p_hat = torch.linalg.qr(p).Q
            q = sum(m.T @ p_hat for m in m_local) / WORKERS
            low_rank = p_hat @ q.T
            for w in range(WORKERS):
                residuals[(w, name)] = m_local[w] - low_rank
            q_state[name] = q
            update[name] = low_rank.reshape(-1)
        updates.append(update)
    return updates


@pytest.mark.parametrize("warm_start,start_step", [(True, 0), (False, 0), (True, 2)])
def test_matches_a_float64_reference_over_several_steps(warm_start: bool, start_step: int) -> None:
    exchange = SimulatedExchange(PowerSGD(rank=RANK, warm_start=warm_start, start_step=start_step), WORKERS,
                                 min_compress_numel=1)
    for step, expected in enumerate(_reference(warm_start, start_step)):
        for worker in range(WORKERS):
            exchange.add_worker(worker, list(_grads(worker, step).items()))
        aggregate = exchange.finish_step()
        for name in SHAPES:
            torch.testing.assert_close(aggregate[name], expected[name], rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    compressed = exchange.step_stats.elements_sent
    dense = sum(torch.Size(s).numel() for s in SHAPES.values())
    assert compressed < dense / 2


def test_bytes_per_matrix_are_n_plus_m_times_r() -> None:
    exchange = SimulatedExchange(PowerSGD(rank=2), workers=2, min_compress_numel=1)
    for worker in range(2):
        exchange.add_worker(worker, [("w", torch.randn(100, 60))])
    exchange.finish_step()
    flag = 4  # the bucket's finiteness flag rides in the last all-reduce
    assert exchange.step_stats.collectives == [("all_reduce", 100 * 2 * 4), ("all_reduce", 60 * 2 * 4 + flag)]
    assert exchange.step_stats.bytes_sent == (100 + 60) * 2 * 4 + flag


def test_conv_weights_are_matrices_of_out_by_in_kh_kw() -> None:
    compressor = PowerSGD(rank=4)
    assert compressor.matrix_shape((64, 32, 3, 3)) == (64, 288, 4)
    assert compressor.matrix_shape((10,)) is None
    assert compressor.matrix_shape((4, 4)) is None  # (4 + 4) * 4 * 2 > 16: dense pays better
    assert compressor.wire_format((64, 32, 3, 3), torch.float32) == [[(torch.float32, 256)], [(torch.float32, 1152)]]
    assert compressor.wire_format((64, 32, 3, 3), torch.bfloat16)[0] == [(torch.float32, 256)]


def test_warm_start_q_is_kept_per_parameter_and_checkpointed() -> None:
    exchange = SimulatedExchange(PowerSGD(rank=2), workers=2, min_compress_numel=1)
    for worker in range(2):
        exchange.add_worker(worker, [("w", torch.randn(50, 40))])
    exchange.finish_step()
    states = exchange.state_dicts()
    q0, q1 = (state["memory"]["states"]["w"]["q"] for state in states)
    assert q0.shape == (40, 2) and torch.equal(q0, q1), "every worker keeps the same averaged Q"
    assert states[0]["memory"]["residuals"]["w"].shape == (2000,)


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "`rank` must be an integer >= 1"),
    ({"start_step": -1}, "`start_step` must be an integer >= 0"),
    ({"warm_start": "yes"}, "`warm_start` must be True or False"),
    ({"min_compression_rate": 0.5}, "`min_compression_rate` must be a finite number >= 1"),
])
def test_bad_arguments_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PowerSGD(**kwargs)


@pytest.mark.multiprocess
def test_powersgd_trains_digits_within_two_points_of_ddp(lightning_runs) -> None:
    ddp, _ = lightning_runs("ddp", "--strategy", "ddp", "--epochs", "10", "--test")
    power, _ = lightning_runs("powersgd", "--compressor", "powersgd", "--epochs", "10", "--test")
    assert power[0]["hook_step"] == ddp[0]["global_step"]
    assert all(torch.equal(power[0]["params"][k], power[1]["params"][k]) for k in power[0]["params"])
    first = power[0]["steps"][0]
    assert first["bytes_dense"] / first["bytes_sent"] > 3
    assert power[0]["test_acc"] >= ddp[0]["test_acc"] - 0.02, (power[0]["test_acc"], ddp[0]["test_acc"])
