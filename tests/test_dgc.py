"""Deep Gradient Compression: the equations element for element, sampled selection, optimizer checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gradcomp.compressors import DGC, CompressContext, TopK
from lightning_gradcomp.compressors.dgc import MOMENTUM, VELOCITY
from lightning_gradcomp.compressors.selection import exact_topk, sampled_topk


def reference_dgc(grads: list[np.ndarray], k: int, m: float, nesterov: bool, clip: float | None,
                  world_size: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """DGC written directly from the paper's equations, one element at a time, in float64."""
    d = grads[0].size
    u, v = np.zeros(d), np.zeros(d)
    history = []
    for g in grads:
        g = g.astype(np.float64).copy()
        if clip is not None:
            limit = clip / np.sqrt(world_size)
            norm = np.sqrt(sum(x * x for x in g))
            if norm > limit:
                g = g * (limit / norm)
        for i in range(d):
            u[i] = m * u[i] + g[i]
            v[i] = v[i] + (g[i] + m * u[i] if nesterov else u[i])
        chosen = sorted(range(d), key=lambda i: -abs(v[i]))[:k]
        sent = np.zeros(d)
        for i in chosen:
            sent[i] = v[i]
            u[i] = 0.0  # momentum-factor masking
            v[i] = 0.0
        history.append((sent, u.copy(), v.copy()))
    return history


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_momentum_correction_and_masking_match_the_equations(nesterov: bool, clip: float | None) -> None:
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(300) for _ in range(6)]
    compressor = DGC(density=0.05, momentum=0.9, nesterov=nesterov, clip_norm=clip, selection="exact")
    state: dict[str, torch.Tensor] = {}
    expected = reference_dgc(grads, k=15, m=0.9, nesterov=nesterov, clip=clip, world_size=4)
    for step, (g, (sent, u, v)) in enumerate(zip(grads, expected)):
        ctx = CompressContext("w", step=step, world_size=4, state=state)
        payload = compressor.compress(torch.tensor(g, dtype=torch.float64), ctx)
        assert payload.count == 15
        np.testing.assert_allclose(compressor.decompress(payload, torch.float64).numpy(), sent, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(state[MOMENTUM].numpy(), u, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(state[VELOCITY].numpy(), v, rtol=1e-12, atol=1e-12)


def test_density_one_is_momentum_sgd_without_masking() -> None:
    compressor = DGC(density=1.0, momentum=0.9)
    state: dict[str, torch.Tensor] = {}
    buffer = torch.zeros(50, dtype=torch.float64)
    for step in range(4):
        g = torch.randn(50, dtype=torch.float64)
        buffer = 0.9 * buffer + g  # torch.optim.SGD's momentum buffer
        payload = compressor.compress(g, CompressContext("w", step=step, state=state))
        assert payload.parts[1].numel() == 0, "dense payload: values only"
        torch.testing.assert_close(compressor.decompress(payload, torch.float64), buffer)
        torch.testing.assert_close(compressor.dense(g * 0, CompressContext("b", state={})), g * 0)


def test_dense_tensors_receive_momentum() -> None:
    compressor, state = DGC(momentum=0.5), {}
    first = compressor.dense(torch.ones(3), CompressContext("b", state=state))
    second = compressor.dense(torch.ones(3), CompressContext("b", state=state))
    torch.testing.assert_close(first, torch.ones(3))
    torch.testing.assert_close(second, torch.full((3,), 1.5))


def test_non_finite_gradient_does_not_poison_dgc_state() -> None:
    compressor, state = DGC(density=0.1, momentum=0.9), {}
    compressor.compress(torch.randn(100), CompressContext("w", step=0, state=state))
    bad = torch.randn(100)
    bad[7] = float("nan")
    compressor.compress(bad, CompressContext("w", step=1, state=state))
    assert torch.isfinite(state[MOMENTUM]).all() and torch.isfinite(state[VELOCITY]).all()


@pytest.mark.parametrize("distribution", ["gaussian", "student_t2", "cauchy", "sparse_spiky"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_sampled_selection_stays_in_band_and_equals_exact_topk(distribution: str, density: float) -> None:
    """Band: the threshold lets through between k and 4k candidates, and exactly k are sent."""
    generator = torch.Generator().manual_seed(12345)  # not a seed the sampler below uses
    n = 200_000
    if distribution == "gaussian":
        x = torch.randn(n, generator=generator)
    elif distribution == "student_t2":
        x = torch.distributions.StudentT(2.0).sample((n,))  # heavy tails: infinite variance
    elif distribution == "cauchy":
        x = torch.distributions.Cauchy(0.0, 1.0).sample((n,))  # heavier: no mean
    else:
        x = torch.zeros(n)
        spikes = torch.randint(0, n, (n // 50,), generator=generator)
        x[spikes] = torch.randn(spikes.numel(), generator=generator) * 100
        x += torch.randn(n, generator=generator) * 1e-3
    magnitude = x.abs()
    k = int(round(density * n))
    for seed in range(100, 105):
        selection = sampled_topk(magnitude, k, torch.Generator().manual_seed(seed))
        assert selection.indices.numel() == k
        assert k <= selection.candidates <= 4 * k, (selection.candidates, k)
        assert set(selection.indices.tolist()) == set(exact_topk(magnitude, k).tolist())


def test_sampled_dgc_sends_exactly_k_entries() -> None:
    compressor = DGC(density=0.01, momentum=0.9)
    payload = compressor.compress(torch.randn(100_000), CompressContext("w", state={}))
    assert payload.count == 1000 and payload.parts[1].numel() == 1000
    assert payload.parts[1].unique().numel() == 1000


class _Params(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def test_optimizer_momentum_on_top_of_dgc_momentum_is_refused() -> None:
    params = _Params().parameters()
    with pytest.raises(ValueError, match=r"DGC\(momentum=0.9\) holds the momentum, but SGD applies momentum=0.9"):
        DGC(momentum=0.9).check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    DGC(momentum=0.9).check_optimizer(torch.optim.SGD(_Params().parameters(), lr=0.1, weight_decay=1e-4))
    DGC(momentum=0.0).check_optimizer(torch.optim.SGD(_Params().parameters(), lr=0.1, momentum=0.9))
    TopK().check_optimizer(torch.optim.SGD(_Params().parameters(), lr=0.1, momentum=0.9))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"momentum": 1.0}, r"`momentum` must be a number in \[0, 1\)"),
        ({"clip_norm": 0}, "`clip_norm` must be None or a finite number > 0"),
        ({"selection": "fast"}, "`selection` must be one of 'blocks', 'sampled', 'exact'"),
        ({"density": 0}, r"`density` must be a number in \(0, 1\]"),
    ],
)
def test_dgc_rejects_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DGC(**kwargs)


def test_generic_error_feedback_cannot_be_forced_on_dgc() -> None:
    from lightning_gradcomp import GradCompStrategy

    with pytest.raises(ValueError, match="`error_feedback` must be None or False with DGC"):
        GradCompStrategy(compressor=DGC(), error_feedback=True)


def test_optimizer_with_a_first_moment_is_refused_under_dgc_momentum() -> None:
    with pytest.raises(ValueError, match=r"Adam keeps a first moment too \(betas\[0\]=0.9"):
        DGC(momentum=0.9).check_optimizer(torch.optim.Adam(_Params().parameters(), lr=1e-3))


def test_density_one_after_sparse_steps_flushes_the_velocity() -> None:
    compressor, state = DGC(density=0.1, momentum=0.0), {}
    g = torch.randn(100, dtype=torch.float64)
    compressor.compress(g, CompressContext("w", step=0, state=state))
    left_over = state[VELOCITY].clone()
    compressor.density = 1.0
    payload = compressor.compress(g, CompressContext("w", step=1, state=state))
    torch.testing.assert_close(compressor.decompress(payload, torch.float64), g + left_over)
    assert VELOCITY not in state


def test_fp16_mixed_precision_is_refused_with_memory_but_not_without() -> None:
    from types import SimpleNamespace

    from lightning_gradcomp.lightning.options import check_fit_setup

    scaled = SimpleNamespace(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"precision='16-mixed' .* allowed: precision='bf16-mixed'"):
        check_fit_setup(TopK(0.01), True, [], scaled)
    with pytest.raises(ValueError, match="16-mixed"):
        check_fit_setup(DGC(), False, [], scaled)
    from lightning_gradcomp.compressors import QSGD

    check_fit_setup(QSGD(), False, [], scaled)  # unbiased, no memory: fine
    check_fit_setup(TopK(0.01), True, [], SimpleNamespace(scaler=None))  # bf16-mixed / 32-true: fine
