"""Adaptive compression schedules: the 004 step function, the ACCORDION trigger, and rank agreement."""

from __future__ import annotations

import pytest

from lightning_gradcomp.callbacks import AdaptiveCompression, GradientNormTrigger
from lightning_gradcomp.compressors import QSGD
from lightning_gradcomp.lightning.callbacks.adaptive import critical_layers

LEVELS = [{"bits": 4}, {"bits": 8}, {"bits": 16}, None]


def test_scripted_validation_values_drive_each_step_the_escape_and_the_return() -> None:
    schedule = AdaptiveCompression("val_acc", LEVELS, thresholds=[0.6, 0.8, 0.9], patience=3, escape_epochs=2)
    script = [0.40, 0.61, 0.70, 0.75, 0.78, 0.79, 0.79, 0.85, 0.95, 0.97]
    messages = [schedule.step(v) for v in script]
    # level: 0 | 1 (passed .6) | 1 1 1 -> stuck 3 epochs: escape (-1) for 2 epochs | back to 1 | 2 (passed .8) | 3 (.9)
    assert schedule.state.history == [0, 1, 1, 1, -1, -1, 1, 2, 3, 3]
    assert schedule.current_level is None  # the last level is uncompressed
    assert "val_acc=0.61 passed 0.6: level 1 {'bits': 8}" in messages[1]
    assert "stuck 3 epochs on level 1: compression off for 2 epoch(s)" in messages[4]
    assert "escape over, back to level 1" in messages[6]
    assert [m is None for m in messages] == [True, False, True, True, False, True, False, False, False, True]


def test_escape_hides_the_compressor_and_a_lower_is_better_metric() -> None:
    schedule = AdaptiveCompression("val_loss", [{"density": 0.01}, {"density": 0.1}], thresholds=[0.5],
                                   mode="min", patience=1, escape_epochs=1)
    schedule.step(0.9)
    assert schedule.current_level is None and schedule.state.history == [-1]
    schedule.step(0.8)
    assert schedule.current_level == {"density": 0.01}
    schedule.step(0.4)
    assert schedule.current_level == {"density": 0.1}


def test_a_stalled_training_loss_also_moves_to_the_next_level() -> None:
    schedule = AdaptiveCompression("val_acc", LEVELS, thresholds=[0.9, 0.95, 0.99], loss_delta=0.01)
    schedule.step(0.1, train_loss=1.0)
    schedule.step(0.1, train_loss=0.8)
    message = schedule.step(0.1, train_loss=0.795)
    assert schedule.state.level == 1 and "training loss changed by less than 0.01" in message


def test_schedule_state_round_trips_through_the_checkpoint() -> None:
    schedule = AdaptiveCompression("val_acc", LEVELS, thresholds=[0.6, 0.8, 0.9], patience=2)
    for value in (0.7, 0.7, 0.7):
        schedule.step(value)
    restored = AdaptiveCompression("val_acc", LEVELS, thresholds=[0.6, 0.8, 0.9], patience=2)
    restored.load_state_dict(schedule.state_dict())
    assert restored.state == schedule.state and restored.current_level == schedule.current_level


@pytest.mark.parametrize(
    "kwargs,match",
    [({"thresholds": [0.5]}, r"`thresholds` must hold len\(levels\) - 1 = 3 values, got 1"),
     ({"mode": "up"}, "`mode` must be 'max' or 'min'"),
     ({"levels": []}, "`levels` must be a non-empty list"),
     ({"patience": 0}, "`patience` must be an integer >= 1")],
)
def test_adaptive_rejects_bad_settings(kwargs, match) -> None:
    args = {"monitor": "val_acc", "levels": LEVELS, "thresholds": [0.6, 0.8, 0.9], **kwargs}
    with pytest.raises(ValueError, match=match):
        AdaptiveCompression(**args)


def test_level_keys_must_be_compressor_parameters() -> None:
    from lightning_gradcomp.lightning.callbacks.adaptive import check_level_keys

    check_level_keys(QSGD(), LEVELS, "test")
    with pytest.raises(ValueError, match="a level sets `density`, which QSGD does not have; allowed: bits, bucket_size, levels"):
        check_level_keys(QSGD(), [{"density": 0.1}], "test")


def test_qsgd_bits_is_the_quantiser_a_schedule_moves_along() -> None:
    q = QSGD(bits=8)
    assert (q.levels, q.bits) == (127, 8)
    for bits in range(2, 17):
        q.bits = bits
        assert q.bits == bits and q.levels == 2 ** (bits - 1) - 1
    with pytest.raises(ValueError, match=r"`bits` must be an integer in \[2, 32\]"):
        q.bits = 1


def test_critical_layers_on_a_constructed_sequence_of_norms() -> None:
    assert critical_layers({"a": 1.0, "b": 2.0}, {"a": 0.4, "b": 1.9}, 0.5) == ["a"]
    assert critical_layers({"a": 1.0}, {"a": 1.6}, 0.5) == ["a"]
    assert critical_layers({"a": 1.0}, {"a": 1.4}, 0.5) == []
    trigger = GradientNormTrigger(low={"density": 0.1}, high={"density": 0.01}, window=2)
    windows = [
        ({"l1": 10.0, "l2": 5.0}, False),   # first window: critical by definition
        ({"l1": 9.0, "l2": 4.5}, False),    # changes of 10%: not critical -> high compression
        ({"l1": 4.0, "l2": 4.4}, False),    # l1 fell by 56%: critical
        ({"l1": 3.9, "l2": 4.3}, False),    # calm again
        ({"l1": 3.8, "l2": 4.2}, True),     # the learning rate dropped: critical
    ]
    decisions = [trigger.decide(norms, lr_dropped) for norms, lr_dropped in windows]
    assert decisions == [True, False, True, False, True]
    trigger.decide({"l1": 3.8, "l2": 4.2}, False)
    assert trigger.current_level == {"density": 0.01}


@pytest.mark.multiprocess
def test_both_ranks_use_the_same_level_at_every_step(lightning_runs) -> None:
    runs, output = lightning_runs("adaptive", "--compressor", "qsgd", "--epochs", "6", "--adaptive", "--validate")
    levels = [[(s["global_step"], s["active"]) for s in rank["steps"]] for rank in runs]
    assert len(runs) == 2 and levels[0] == levels[1]
    active = [a for _, a in levels[0]]
    assert active[0] == "QSGD(levels=1, bucket_size=512)", active[0]
    assert len(set(active)) >= 2, "the schedule moved"
    printed = [line for line in output.splitlines() if "gradcomp AdaptiveCompression, epoch" in line]
    changes = len([1 for a, b in zip(active, active[1:]) if a != b])
    assert len(printed) == len(set(printed)), "each change is printed once, by rank 0 only"
    assert changes <= len(printed) <= changes + 1  # the last epoch's change has no step after it


def test_an_uncompressed_level_is_refused_for_dgc() -> None:
    from lightning_gradcomp.lightning.callbacks.adaptive import check_level_keys
    from lightning_gradcomp.compressors import DGC

    with pytest.raises(ValueError, match=r"an uncompressed level \(None\) would drop DGC's momentum"):
        check_level_keys(DGC(), [{"density": 0.01}, None], "test")
    check_level_keys(DGC(), [{"density": 0.01}, {"density": 1.0}], "test")
