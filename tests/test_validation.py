"""Bad configuration fails early with a ValueError that names the parameter and the allowed values."""

from __future__ import annotations

import pytest

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import QSGD, HardThreshold, RandomK, TopK, get_compressor


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "0.1", True])
@pytest.mark.parametrize("cls", [TopK, RandomK])
def test_density_outside_unit_interval(cls, density) -> None:
    with pytest.raises(ValueError, match=r"`density` must be a number in \(0, 1\]"):
        cls(density=density)


def test_density_is_checked_when_a_schedule_changes_it() -> None:
    compressor = TopK(0.1)
    with pytest.raises(ValueError, match="`density`"):
        compressor.density = 2.0
    assert compressor.density == 0.1


@pytest.mark.parametrize("levels", [0, -3, 2.5, True])
def test_qsgd_levels_below_one(levels) -> None:
    with pytest.raises(ValueError, match=r"`levels` must be an integer in \[1, "):
        QSGD(levels=levels)


def test_qsgd_bucket_size() -> None:
    with pytest.raises(ValueError, match="`bucket_size` must be an integer >= 1"):
        QSGD(bucket_size=0)


@pytest.mark.parametrize("threshold", [-1e-3, float("nan"), float("inf"), "x"])
def test_negative_threshold(threshold) -> None:
    with pytest.raises(ValueError, match="`threshold` must be a finite number >= 0"):
        HardThreshold(threshold=threshold)


def test_unknown_compressor_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"`compressor`: unknown name 'topkk'; allowed names: .*qsgd.*topk"):
        get_compressor("topkk")
    with pytest.raises(ValueError, match="`compressor`: unknown name"):
        GradCompStrategy(compressor="zip")
    with pytest.raises(ValueError, match="`compressor` must be a Compressor instance or one of"):
        GradCompStrategy(compressor=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ddp_comm_hook": lambda s, b: None}, "`ddp_comm_hook` must be None"),
        ({"ddp_comm_state": object()}, "`ddp_comm_state` must be None"),
        ({"ddp_comm_wrapper": lambda h: h}, "`ddp_comm_wrapper` must be None"),
        ({"model_averaging_period": 4}, "`model_averaging_period` must be None"),
        ({"bucket_cap": 25}, r"unknown DistributedDataParallel argument\(s\) \['bucket_cap'\]; allowed: .*bucket_cap_mb"),
        ({"bucket_cap_mb": 0}, "`bucket_cap_mb` must be a number > 0"),
        ({"error_feedback": "yes"}, "`error_feedback` must be None, True or False"),
        ({"min_compress_numel": -1}, "`min_compress_numel` must be an integer >= 0"),
        ({"seed": 1.5}, "`seed` must be an integer >= 0"),
        ({"start_method": "thread"}, "`start_method` must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
    ],
)
def test_strategy_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GradCompStrategy(**kwargs)


def test_strategy_accepts_every_ddp_argument() -> None:
    strategy = GradCompStrategy(compressor="qsgd", find_unused_parameters=True, static_graph=False,
                                bucket_cap_mb=10, gradient_as_bucket_view=True, process_group_backend="gloo")
    assert isinstance(strategy.compressor, QSGD)
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 10


def test_registered_names_build_the_strategy() -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="gradcomp_spawn", logger=False)
    assert isinstance(trainer.strategy, GradCompStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert isinstance(trainer.strategy.compressor, TopK)
