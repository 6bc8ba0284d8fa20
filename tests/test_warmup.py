"""DGCWarmup's schedule without a Trainer: epochs, steps, custom densities, the target floor."""

from __future__ import annotations

import pytest

from lightning_gradcomp.callbacks import DGCWarmup
from lightning_gradcomp.lightning.callbacks.warmup import paper_densities


def test_paper_sequence_by_epoch() -> None:
    warmup = DGCWarmup(epochs=4, target=0.001)
    assert [warmup.density_at(e, 0) for e in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert paper_densities(4) == [0.25, 0.0625, 0.015625, 0.00390625]


def test_by_steps_spreads_the_stages_evenly() -> None:
    warmup = DGCWarmup(steps=100, target=0.001)
    assert [warmup.density_at(0, s) for s in (0, 24, 25, 49, 50, 75, 99, 100, 500)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]


def test_custom_densities_never_go_below_the_target() -> None:
    warmup = DGCWarmup(epochs=3, densities=[0.5, 0.1, 0.001], target=0.01)
    assert [warmup.density_at(e, 0) for e in range(4)] == [0.5, 0.1, 0.01, 0.01]


@pytest.mark.parametrize(
    "kwargs,match",
    [({}, "give exactly one of `epochs` or `steps`"), ({"epochs": 2, "steps": 10}, "give exactly one of"),
     ({"epochs": 0}, "`epochs` must be an integer >= 1"), ({"epochs": 2, "densities": [0.5, 2.0]}, "`densities`"),
     ({"epochs": 2, "lr_start_factor": 0.0}, "`lr_start_factor`")],
)
def test_warmup_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DGCWarmup(**kwargs)


def test_state_round_trip() -> None:
    warmup = DGCWarmup(epochs=4, target=0.002)
    warmup.base_lrs = [[0.1]]
    restored = DGCWarmup(epochs=4)
    restored.load_state_dict(warmup.state_dict())
    assert restored.target == 0.002 and restored.base_lrs == [[0.1]]
