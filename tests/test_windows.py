"""Time-boxed windows and weighted merging (``lightning_gradcomp/local/windows.py``): the plan, the weights, the
simulation's speeds and stalls, and real processes (plain loops and the Trainer) with a slower group."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from lightning_gradcomp import LocalUpdates
from lightning_gradcomp.local.simulated import SimulatedLocalUpdates
from lightning_gradcomp.local.windows import (
    check_figures,
    GroupFigures,
    merge_weights,
    plan_windows,
    steps_in_window,
    UNBOUNDED,
)
from tests import _window_workers
from tests._processes import free_port, run_gloo, run_lightning, ScriptRun, SCRIPTS
from tests._window_workers import _batch, _model

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _group(step_seconds: float, left: int = UNBOUNDED, units: int = 10) -> GroupFigures:
    return GroupFigures(0, False, units, step_seconds, left)


# ---------------------------------------------------------------------- the plan and the weights
def test_equal_counts_weigh_exactly_one_and_unequal_ones_by_their_share() -> None:
    assert merge_weights([7, 7, 7]) == [1.0, 1.0, 1.0]
    assert merge_weights([0, 0]) == [1.0, 1.0]
    weights = merge_weights([10, 10, 5])
    assert weights == pytest.approx([1.2, 1.2, 0.6])
    assert sum(weights) / 3 == pytest.approx(1.0)


def test_a_group_at_half_speed_takes_half_the_steps_of_an_auto_window() -> None:
    plan = plan_windows([_group(0.01), _group(0.01), _group(0.02)], 0.0, 10, 1, 0)
    assert plan.lengths == [10, 10, 5] and plan.window_seconds == pytest.approx(0.1)
    assert not plan.last and not plan.ends_now
    # fragments: a multiple of F, at least F·(τ+1)
    assert plan_windows([_group(0.01), _group(0.03)], 0.0, 12, 2, 1).lengths == [12, 4]
    assert steps_in_window(0.1, 1.0, 12, 2, 1) == 4
    # a window in seconds; an unmeasured group takes H
    assert plan_windows([_group(0.02), _group(0.0)], 0.5, 10, 1, 0).lengths == [25, 10]


def test_the_last_window_ends_the_shortest_loop_exactly_and_the_others_in_proportion() -> None:
    plan = plan_windows([_group(0.01, left=13), _group(0.02, left=100)], 0.0, 10, 1, 0)
    assert plan.last and plan.lengths == [13, 7]  # 13 steps left: one window of 13, not 10 and 3
    assert not plan_windows([_group(0.01, left=15), _group(0.02)], 0.0, 10, 1, 0).last
    ends = plan_windows([_group(0.01, left=0), _group(0.02)], 0.0, 10, 1, 0)
    assert ends.ends_now


def test_figures_that_do_not_fit_are_refused_with_the_fix() -> None:
    mixed = [GroupFigures(1, False, 80, 0.01, 5), GroupFigures(0, False, 10, 0.01, 5)]
    assert "count(n) on every rank" in check_figures(mixed, "samples", False)
    assert check_figures(mixed, None, False) is None  # equal weights: the counts do not matter
    steps = [GroupFigures(0, False, 10, 0.01, 5)] * 2
    assert "handle.count(tokens)" in check_figures(steps, "tokens", False)
    ending = [GroupFigures(0, True, 10, 0.01, 5), GroupFigures(0, False, 10, 0.01, 5)]
    assert "called sync()" in check_figures(ending, "samples", True)
    unbounded = [GroupFigures(0, False, 10, 0.01, UNBOUNDED)] * 2
    assert "run_for" in check_figures(unbounded, "samples", True)
    assert check_figures(unbounded, "samples", False) is None


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "fast", True])
def test_a_bad_window_is_refused_naming_the_allowed_values(value: object) -> None:
    with pytest.raises(ValueError, match="window_seconds.*'auto'"):
        LocalUpdates(10, window_seconds=value)


def test_a_bad_weight_is_refused_naming_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="weight_by.*'samples'.*'tokens'.*None"):
        LocalUpdates(10, weight_by="bytes")


# ---------------------------------------------------------------------- the simulation
def _simulate(config: LocalUpdates, ticks: int = 40, workers: int = 3, **kwargs) -> tuple[SimulatedLocalUpdates, list]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=workers, **kwargs)
    _tick(sim, model, optimizer, ticks)
    return sim, [p.detach().clone() for p in sim.outer.global_params]


def _tick(sim: SimulatedLocalUpdates, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ticks: int) -> None:
    """``ticks`` ticks of the simulation: the workers whose step falls on each one train a batch."""
    for _ in range(ticks):
        for worker in sim.stepping():
            with sim.worker(worker):
                x, y = _batch(worker, sim.samples[worker])
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        sim.step()


def test_equal_speeds_reproduce_lock_step_bit_for_bit() -> None:
    _, lock_step = _simulate(LocalUpdates(10, OUTER))
    _, time_boxed = _simulate(LocalUpdates(10, OUTER, window_seconds="auto"), speeds=(2, 2, 2))
    _, unweighted = _simulate(LocalUpdates(10, OUTER, weight_by=None))
    assert all(torch.equal(a, b) for a, b in zip(lock_step, time_boxed))
    assert all(torch.equal(a, b) for a, b in zip(lock_step, unweighted))


def test_the_simulation_steps_follow_the_speeds_and_stalls_not_the_clock() -> None:
    config = LocalUpdates(10, OUTER, window_seconds="auto")
    sim, _ = _simulate(config, speeds=(1, 1, 0.5))
    assert sim.samples == [40, 40, 20] and sim.elapsed == 40.0
    lock, _ = _simulate(LocalUpdates(10, OUTER), speeds=(1, 1, 0.5))
    assert lock.samples == [40, 40, 40] and lock.elapsed == 80.0  # the slowest sets the pace
    # worker 2 loses 4 units in window 1, worker 0 a whole window (and more) in window 2
    stalls = {2: [(1, 4.0)], 0: [(2, 20.0)]}
    stalled, _ = _simulate(config, speeds=(1, 1, 0.5), stalls=stalls)
    assert stalled.samples == [30, 40, 18] and stalled.elapsed == 40.0
    lock_stalled, _ = _simulate(LocalUpdates(10, OUTER), speeds=(1, 1, 0.5), stalls=stalls)
    assert lock_stalled.elapsed == 20 + 24 + 30 + 20  # every window waits for its slowest worker
    with pytest.raises(RuntimeError, match="takes no inner step at this tick"):
        with sim.worker(2) if 2 not in sim.stepping() else sim.worker(99):
            pass


def test_the_simulation_merges_the_replicas_weighted_by_their_steps() -> None:
    """Speeds (1, 0.5), one window of 2 ticks, outer SGD at lr 1: θ_global = (2·θ_0 + 1·θ_1) / 3."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = LocalUpdates(2, functools.partial(torch.optim.SGD, lr=1.0), window_seconds="auto")
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=2, speeds=(1, 0.5))
    replicas = []
    for tick in range(2):
        for worker in sim.stepping():
            with sim.worker(worker):
                x, y = _batch(worker, tick)
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        if tick == 1:
            replicas = [[p.clone() for p in replica.params] for replica in sim.replicas]
        sim.step()
    assert sim.samples == [2, 1]
    for glob, a, b in zip(sim.outer.global_params, *replicas):
        torch.testing.assert_close(glob, (2 * a + b) / 3)


def test_a_bad_speed_or_stall_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="`speeds` must be 2 numbers > 0"):
        SimulatedLocalUpdates(model, [optimizer], LocalUpdates(2), workers=2, speeds=(1, 0))
    with pytest.raises(ValueError, match="`stalls` must map a worker"):
        SimulatedLocalUpdates(model, [optimizer], LocalUpdates(2), workers=2, stalls={5: [(0, 1.0)]})


def test_a_time_boxed_simulation_resumes_exactly() -> None:
    config = LocalUpdates(4, OUTER, window_seconds="auto")
    full, expected = _simulate(config, ticks=12, workers=2, speeds=(1, 0.5))
    first, _ = _simulate(config, ticks=6, workers=2, speeds=(1, 0.5))
    states = first.state_dicts()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    resumed = SimulatedLocalUpdates(model, [optimizer], config, workers=2, speeds=(1, 0.5))
    resumed.load_state_dicts(states)
    _tick(resumed, model, optimizer, 6)
    assert resumed.samples == full.samples and resumed.elapsed == full.elapsed
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed.outer.global_params))


# ---------------------------------------------------------------------- real processes
@pytest.mark.parametrize("compressor", ["none", "int8", "demo"])
def test_reported_samples_weight_the_merge_in_real_processes(compressor: str) -> None:
    run_gloo(_window_workers.weighted_merge, 2, [8, 24], compressor)


def test_ranks_that_count_differently_are_refused_on_every_rank() -> None:
    run_gloo(_window_workers.mixed_reporting, 2)


@pytest.mark.parametrize("schedule", [{"sync_every": 10},
                                      {"sync_every": 12, "fragments": 2, "delay": 1, "overlap": "before", "alpha": 0.5}],
                         ids=["diloco", "streaming"])
def test_a_slow_rank_does_not_hold_up_the_others_and_every_rank_ends_together(tmp_path, schedule: dict) -> None:
    """Three ranks, the last at about half speed (a sleep): under window_seconds='auto' the fast ranks take
    about twice its steps per window, and every rank ends at the same synchronisation with the same θ_global
    (Streaming DiLoCo's fragments too: each window a multiple of F, at least F·(τ+1) steps)."""
    run_gloo(_window_workers.time_boxed_run, 3, [0.01, 0.01, 0.02], {**schedule, "window_seconds": "auto"},
             6 * schedule["sync_every"], str(tmp_path))
    figures = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    params = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(3)]
    assert max(figure["steps"] for figure in figures) == 6 * schedule["sync_every"]  # the first loop whose steps
    assert len({figure["windows"] for figure in figures}) == 1  # run out ends the run, every rank there
    # after the first (lock-step) window the slow rank took about half the fast ranks' steps
    first = schedule["sync_every"]
    slow, fast = figures[2]["steps"] - first, figures[1]["steps"] - first
    assert 0.3 * fast <= slow <= 0.7 * fast, figures
    assert all(torch.equal(params[0][name], other[name]) for other in params[1:] for name in params[0])


def test_the_trainer_stops_every_rank_at_the_planned_end(tmp_path) -> None:
    """The Trainer says its length itself (estimated_stepping_batches), and its per-batch SIGTERM broadcast is
    gone under local updates: the slow rank takes fewer steps and both stop at the same synchronisation."""
    results, _ = run_lightning(tmp_path, "tb", "--local", "4", "--window-seconds", "auto", "--slow-rank-sleep",
                               "0.03", "--max-steps", "40", "--epochs", "20", "--compressor", "none")
    fast, slow = results
    assert fast["global_step"] == 40 and slow["global_step"] < 30, (fast["global_step"], slow["global_step"])
    assert fast["finished"] and slow["finished"] and fast["windows"] == slow["windows"]
    assert all(torch.equal(fast["params"][name], slow["params"][name]) for name in fast["params"])


def _fault_tolerant_groups(tmp_path, join_timeout_ms: int, steps: int, step_seconds: list[float],
                           extra: dict[int, list[str]]) -> list[dict]:
    """Replica groups of ``tests/scripts/ft_replica.py`` (one process each, time-boxed windows of H = 8) under a
    lighthouse on 127.0.0.1 with ``min_replicas=2``; their results."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=3000)
    try:
        runs = [ScriptRun(SCRIPTS / "ft_replica.py",
                          ["--replica", str(group), "--lighthouse", lighthouse.address(), "--port", str(free_port()),
                           "--out", str(tmp_path / f"group{group}"), "--compressor", "int8", "--steps", str(steps),
                           "--sync-every", "8", "--step-seconds", str(seconds), "--window-seconds", "auto",
                           "--expected-groups", str(len(step_seconds)), *extra.get(group, [])], tmp_path,
                          dict(os.environ, OMP_NUM_THREADS="1"))
                for group, seconds in enumerate(step_seconds)]
        outcomes = [run.wait(timeout=180) for run in runs]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes:
        assert code == 0, output[-4000:]
    return [torch.load(tmp_path / f"group{group}.pt", weights_only=False) for group in range(len(step_seconds))]


def test_fault_tolerant_groups_take_their_own_steps_and_end_together(tmp_path) -> None:
    """Two torchft replica groups, the second at a third of the speed, window_seconds='auto': after the first
    window the fast group takes about three times the slow one's steps, both end at the same synchronisation,
    every synchronisation committed, with the same θ_global."""
    fast, slow = _fault_tolerant_groups(tmp_path, 3000, 40, [0.01, 0.03], {})
    assert fast["finished"] and slow["finished"] and fast["windows"] == slow["windows"]
    assert fast["syncs"] == slow["syncs"] and fast["commits"] == fast["syncs"] and fast["rollbacks"] == 0
    fast_steps, slow_steps = len(fast["losses"]) - 8, len(slow["losses"]) - 8  # after the lock-step first window
    assert len(fast["losses"]) == 40 and 0.15 * fast_steps <= slow_steps <= 0.6 * fast_steps, (fast_steps, slow_steps)
    last = max(fast["global"])
    assert all(torch.equal(a, b) for a, b in zip(fast["global"][last], slow["global"][last]))


def test_a_stalled_group_is_left_out_after_the_grace_period_and_takes_part_again(tmp_path) -> None:
    """The grace rule under fault tolerance: the lighthouse's join_timeout (0.4 s here). Group 2 stalls for 2 s once;
    the others wait at most about a window plus the grace period at that synchronisation, not the stall, and go on
    as two; group 2's late window is dropped (it heals from θ_global at its next quorum) and it takes part
    again, and every group ends at the same synchronisation with the same θ_global."""
    stall = 2.0
    groups = _fault_tolerant_groups(tmp_path, 400, 180, [0.02, 0.02, 0.02], {2: ["--stall", "16", str(stall)]})
    late = groups[2]
    assert late["heals"] == 1 and all(group["finished"] for group in groups)
    assert len({group["syncs"] for group in groups}) == 1 and len({group["windows"] for group in groups}) == 1
    for group in groups[:2]:
        gaps = [b - a for a, b in zip(group["synced_at"], group["synced_at"][1:])]
        assert max(gaps) < 0.8 * stall, gaps  # the grace period, not the stall
        seen = group["participants"]
        assert 2 in seen and seen[-1] == 3, seen  # left out once, then back
    last = max(groups[0]["global"])
    assert all(torch.equal(a, b) for group in groups[1:] for a, b in zip(groups[0]["global"][last], group["global"][last]))


def test_the_shards_of_a_replica_take_the_same_steps_under_time_boxed_windows() -> None:
    from tests._fsdp_local_workers import check_time_boxed_windows_on_shards

    run_gloo(check_time_boxed_windows_on_shards, 4)


def test_a_fabric_loop_says_its_length_and_stops_when_finished(tmp_path) -> None:
    """Fabric: `fabric.strategy.gradcomp.run_for(total)`, break when `.finished`; rank 1 at about a third of
    rank 0's speed takes fewer steps, and both end with θ_global."""
    results, _ = run_lightning(tmp_path, "fabric", "--local", "4", "--window-seconds", "auto", "--slow-rank-sleep",
                               "0.02", "--epochs", "2", "--compressor", "none", script="fabric_digits.py")
    fast, slow = results
    assert fast["inner_steps"] == 2 * 22 and 4 < slow["inner_steps"] < fast["inner_steps"] - 8, \
        (fast["inner_steps"], slow["inner_steps"])
    assert all(torch.equal(fast["params"][name], slow["params"][name]) for name in fast["params"])


def test_a_group_that_stalls_inside_a_window_ends_it_at_the_deadline(tmp_path) -> None:
    """Equal speeds, H = 20 (a window of about 0.4 s); the last rank stalls 0.25 s two steps into its second
    window: it ends that window at the deadline with fewer steps, so the others' synchronisations keep their
    pace (lock-step would make them wait the stall)."""
    run_gloo(_window_workers.time_boxed_run, 3, [0.02, 0.02, 0.02], {"sync_every": 20, "window_seconds": "auto"},
             100, str(tmp_path), (22, 0.25))
    figures = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    steps = [figure["steps"] for figure in figures]
    # the group whose steps run out first ends exactly at its last one (rank 0 or 1: equal speeds, so which one
    # depends on the clock); the others end at the same synchronisation, in proportion to their speed
    assert max(steps[:2]) == 100 and min(steps[:2]) >= 95 and steps[2] < max(steps[:2]), steps
    for figure in figures[:2]:
        gaps = [b - a for a, b in zip(figure["synced_at"], figure["synced_at"][1:])]
        assert max(gaps) - sorted(gaps)[len(gaps) // 2] < 0.15, gaps  # well under the 0.25 s stall


def test_the_trainer_refuses_a_checkpoint_at_each_ranks_own_step() -> None:
    """Under time-boxed windows the ranks take different numbers of steps: a ModelCheckpoint that saves at each
    rank's own epoch end (the default one) is refused before training, naming what is allowed."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradcomp import GradCompStrategy
    from tests.test_bad_inputs import _Tiny

    data = DataLoader(TensorDataset(torch.randn(16, 40)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        strategy=GradCompStrategy(local_updates=LocalUpdates(2, window_seconds="auto")),
                        enable_checkpointing=True, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_model_summary=False)
    try:
        with pytest.raises(ValueError, match="ModelCheckpoint.save_on_train_epoch_end=False.*enable_checkpointing=False"):
            trainer.fit(_Tiny(False), data)
    finally:  # Lightning leaves its 1-process group behind after a refusal in setup: later tests need none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_trainer_validates_and_checkpoints_at_synchronisations(tmp_path) -> None:
    """Validation inside fit (sync_dist logging and a torchmetrics metric: collectives) and a
    ModelCheckpoint(save_on_train_epoch_end=False), a slow rank: validation runs right after the same
    synchronisations on both ranks (θ_global: the same parameters), one checkpoint per validation under rank 0's
    name with every rank's part beside it, and both ranks stop together."""
    checkpoints = tmp_path / "checkpoints"
    results, _ = run_lightning(tmp_path, "tbv", "--local", "4", "--window-seconds", "auto", "--slow-rank-sleep",
                               "0.03", "--max-steps", "40", "--epochs", "20", "--compressor", "none", "--validate",
                               "--checkpoint-dir", str(checkpoints))
    fast, slow = results
    assert fast["global_step"] == 40 and slow["global_step"] < 30 and fast["windows"] == slow["windows"]
    assert fast["validated"] == slow["validated"] and len(fast["validated"]) >= 2, (fast["validated"], slow["validated"])
    saved = sorted(checkpoints.glob("*.ckpt"))
    assert len(saved) == len(fast["validated"]), saved
    assert all(sorted(path.name for path in Path(f"{ckpt}.gradcomp").iterdir()) == ["rank00000.pt", "rank00001.pt"]
               for ckpt in saved)
    assert all(torch.equal(fast["params"][name], slow["params"][name]) for name in fast["params"])
