"""Fault-tolerant local updates on torchft (``local_updates(..., fault_tolerance=FaultTolerance(...))``): real
replica groups of one process each, torchft's lighthouse on 127.0.0.1 started here; skipped without torchft (the
``ft`` extra). A group killed inside a window: the others finish; a replacement joins and receives θ_global."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests._processes import free_port, run_gloo, SCRIPTS, ScriptRun

pytestmark = pytest.mark.multiprocess

STEPS, H = 60, 4
#: long enough that a replacement started after the kill joins the survivors before they finish, also on a loaded machine
STEP_SECONDS = "0.15"


def _start(replica: str, lighthouse: str, tmp_path: Path, compressor: str, *extra: str) -> ScriptRun:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return ScriptRun(SCRIPTS / "ft_replica.py",
                     ["--replica", replica, "--lighthouse", lighthouse, "--port", str(free_port()), "--out",
                      str(tmp_path / f"group{replica}-{len(list(tmp_path.glob('*')))}"), "--compressor", compressor,
                      "--steps", str(STEPS), "--sync-every", str(H), "--step-seconds", STEP_SECONDS, *extra], tmp_path, env)


# (uncompressed, the same groups equal torchft's own DiLoCo bit for bit: tests/test_torchft_diloco.py; the kill
# and replacement are the same for every compressor, so the suite runs the compressed ones)
@pytest.mark.parametrize("compressor, fragments, delay",
                         [("int8", 1, 0), ("sparseloco", 1, 0), ("int8", 2, 1)],
                         ids=["int8", "sparseloco", "streaming-int8"])
def test_a_lost_group_costs_its_window_and_a_replacement_receives_theta_global(compressor: str, fragments: int,
                                                                                delay: int, tmp_path: Path) -> None:
    """(``streaming-int8``: Streaming DiLoCo, 2 fragments each synchronised every H steps, staggered by H/2,
    the exchange overlapping 1 inner step: a quorum and a commit per fragment.)"""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    # two groups make a quorum; a starting group is waited for up to 3 s; one silent for 1.5 s is dropped
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
    schedule = ["--fragments", str(fragments), "--delay", str(delay)]
    try:
        runs = [_start(str(r), lighthouse.address(), tmp_path, compressor, *schedule,
                       *(["--die-at", "10"] if r == 2 else [])) for r in range(3)]
        code, output = runs[2].wait(timeout=120)  # group 2 leaves after inner step 10, inside its third window
        assert code == 0, output[-3000:]
        time.sleep(2.0)  # the survivors synchronise without it (a 1.5 s heartbeat timeout), then the replacement starts
        replacement = _start("2", lighthouse.address(), tmp_path, compressor, *schedule)
        outcomes = [run.wait(timeout=180) for run in (runs[0], runs[1], replacement)]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes:
        assert code == 0, output[-4000:]
    survivors = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("group[01]-*.pt"))]
    (joined,) = [torch.load(path, weights_only=False) for path in tmp_path.glob("group2-*.pt")]
    # a fragment's synchronisation every H / fragments steps; with a delay the last one is still in flight at the end
    stride, syncs = H // fragments, STEPS // H * fragments - (1 if delay else 0)
    for result in survivors:  # (a group that started late joined at the first synchronisation, after step H/F)
        assert result["first_step"] in (0, stride) and result["syncs"] == syncs and result["rollbacks"] == 0, result
        assert result["commits"] == syncs
        steps = [step for step, _ in result["losses"]]
        assert steps == list(range(result["first_step"] + 1, STEPS + 1)), "every step once, none skipped"
        seen = result["participants"]  # the join (a group that starts late joins at the first synchronisation)
        assert 3 in seen[:3] and 2 in seen[3:] and seen[-1] == 3, seen  # all three, two after the kill, three again
        first = sum(loss for _, loss in result["losses"][:4]) / 4
        last = sum(loss for _, loss in result["losses"][-4:]) / 4
        # the loss keeps falling (SparseLoCo's ~1% outer gradients learn slowest: 2.34 -> 1.98 in one 60-step run)
        assert last < (0.9 if compressor == "sparseloco" else 0.7) * first, (first, last)
        assert f"fault tolerance: {result['commits']} synchronisations, {result['commits']} committed" in result["summary"]
    # the replacement joined at one of the survivors' synchronisations: it held their θ_global there
    joined_at = min(joined["global"])
    assert 3 <= joined_at < syncs and joined["heals"] == 1 and joined["first_step"] % stride == 0, joined_at
    # its summary's per-step figures cover the steps it ran, not the job's
    assert f"in {STEPS - joined['first_step']} optimizer steps" in joined["summary"], joined["summary"]
    for result in survivors:
        assert all(torch.equal(a, b) for a, b in zip(joined["global"][joined_at], result["global"][joined_at]))
    # and every group ends on the same θ_global (and, when the run ends on a whole model's merge, parameters)
    for result in [*survivors[1:], joined]:
        assert all(torch.equal(a, b) for a, b in zip(result["global"][syncs], survivors[0]["global"][syncs]))
        if fragments == 1:
            assert all(torch.equal(a, b) for a, b in zip(result["params"], survivors[0]["params"]))


def test_a_group_lost_during_an_exchange_rolls_the_synchronisation_back_and_the_next_one_commits(tmp_path: Path) -> None:
    """Group 2 leaves after joining the quorum of synchronisation 3, before its exchange: the survivors' exchange
    fails, both roll it back (θ_global unchanged, the window's steps dropped) with a warning, and synchronisation 3
    is retried at the end of the next window without group 2; every step runs once. Later group 1 claims another
    fragment in the agreement check before synchronisation 5's exchange: both roll it back too (no crash)."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
    try:
        extra = {1: ["--disagree-in-sync", "5"], 2: ["--die-in-sync", "3"]}
        runs = [_start(str(r), lighthouse.address(), tmp_path, "int8", *extra.get(r, [])) for r in range(3)]
        outcomes = [run.wait(timeout=180) for run in runs]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes[:2]:
        assert code == 0, output[-4000:]
        assert "was rolled back" in output and "disagree on this synchronisation" in output, output[-4000:]
    survivors = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("group[01]-*.pt"))]
    for result in survivors:
        assert result["rollbacks"] == 2 and result["syncs"] == STEPS // H - 2, result["syncs"]  # two windows dropped
        steps = [step for step, _ in result["losses"]]
        assert steps == list(range(result["first_step"] + 1, STEPS + 1))
        # θ_global did not move at the rolled-back synchronisation: the one after it starts from synchronisation 2's
        assert sorted(result["global"]) == list(range(result["global"] and min(result["global"]), STEPS // H - 1))
    assert all(torch.equal(a, b) for a, b in zip(survivors[0]["params"], survivors[1]["params"]))


def test_groups_launched_together_wait_for_each_other_at_a_fresh_start(tmp_path: Path) -> None:
    """With the lighthouse's min_replicas=1, group 0 alone would form the first quorum and train; with
    FaultTolerance(expected_groups=2) it waits at step 0 for group 1, started 1 s later: both start from the
    same quorum (no heal), every synchronisation has both, and they end on the same parameters. (Without it,
    group 0 ran all 12 steps alone: participants [1, 1, 1, 1].)"""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
    try:
        short = ["--steps", "12", "--step-seconds", "0.02", "--expected-groups", "2"]
        first = _start("0", lighthouse.address(), tmp_path, "int8", *short)
        time.sleep(1.0)
        outcomes = [run.wait(timeout=120) for run in (first, _start("1", lighthouse.address(), tmp_path, "int8", *short))]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes:
        assert code == 0, output[-4000:]
    groups = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("group[01]-*.pt"))]
    for result in groups:
        assert result["first_step"] == 0 and result["heals"] == 0, result
        assert result["participants"] == [2] * 4 and result["syncs"] == 3 and result["commits"] == 3, result
    assert all(torch.equal(a, b) for a, b in zip(groups[0]["params"], groups[1]["params"]))


def test_row_blocks_split_rows_as_fsdp2_does() -> None:
    """A replica group of DDP processes exchanges row blocks (``torch.chunk`` of dim 0): uneven rows, fewer
    rows than ranks (empty blocks), a 0-d tensor (one row)."""
    from lightning_gradcomp.local.fault_tolerance import row_blocks

    blocks = row_blocks((5, 3), 2)
    assert [(b.start, b.stop, b.shape) for b in blocks] == [(0, 9, (3, 3)), (9, 15, (2, 3))]
    assert [tuple(chunk.shape) for chunk in torch.zeros(5, 3).chunk(2)] == [b.shape for b in blocks]
    assert [(b.start, b.stop) for b in row_blocks((2,), 4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert [(b.start, b.stop, b.shape) for b in row_blocks((), 2)] == [(0, 1, (1,)), (1, 1, (0,))]


def test_trainer_replica_groups_survive_a_lost_group_and_a_replacement_stops_with_the_others(tmp_path: Path) -> None:
    """Three Trainers (``devices=1``), ``GradCompStrategy(local_updates=4, fault_tolerance=...)``, 60 steps: group 2
    leaves after step 10; a replacement joins later and stops when the groups' step count reaches max_steps;
    all end on the same weights; the figures reach the logs (the strategy's and CompressionMonitor's) and the summary."""
    pytest.importorskip("torchft")
    import csv

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(replica: str, name: str, *extra: str) -> ScriptRun:
        return ScriptRun(SCRIPTS / "ft_trainer.py", ["--replica", replica, "--lighthouse", lighthouse.address(),
                                                      "--out", str(tmp_path / name), "--steps", str(STEPS),
                                                      "--step-seconds", STEP_SECONDS, *extra], tmp_path, env)

    try:
        runs = [start(str(r), f"trainer{r}", *(["--die-at", "10"] if r == 2 else [])) for r in range(3)]
        code, output = runs[2].wait(timeout=120)
        assert code == 0, output[-3000:]
        time.sleep(2.0)
        replacement = start("2", "replacement")
        outcomes = [run.wait(timeout=180) for run in (runs[0], runs[1], replacement)]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes:
        assert code == 0, output[-4000:]
        assert "fault tolerance:" in output and "committed" in output, output[-2000:]
    results = [torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("trainer0", "trainer1", "replacement")]
    for result in results:
        assert result["optimizer_steps"] == STEPS and result["syncs"] == STEPS // H and result["rollbacks"] == 0, result
        assert all(torch.equal(a, b) for a, b in zip(result["params"], results[0]["params"]))
    assert len({result["sampler_seed"] for result in results}) == 3, "each group shuffles its own way"
    assert 2 in results[0]["participants"] and results[0]["participants"][-1] == 3
    assert results[2]["heals"] == 1 and results[2]["global_step"] < STEPS, "the replacement joined a running job"
    (metrics,) = Path(results[0]["metrics_dir"]).glob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("gradcomp/ft_participants")]
    # a group that started after the others' first quorum joined at their first synchronisation, inside the
    # strategy's setup (a heal, before any training step): that one is not logged
    logged_syncs = STEPS // H - results[0]["heals"]
    assert len({row["step"] for row in rows}) == logged_syncs and {float(row["gradcomp/ft_participants"]) for row in rows} >= {2.0, 3.0}
    assert any(row.get("gradcomp/comm_ms_est") for row in rows), "CompressionMonitor logs them too"


def test_trainer_groups_of_two_ddp_processes_survive_a_lost_group_and_shuffle_their_own_data(tmp_path: Path) -> None:
    """Two Trainers of ``devices=2`` each (DDP inside the group, the two processes splitting the outer
    exchange): group 1 (both processes) leaves after step 6, the survivor goes on alone (``min_replicas=1``),
    a replacement of 2 processes joins, and all four processes end on the same weights; the groups draw
    different batches (each its own shuffling seed), though they run the same script and seed."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1500)

    def start(replica: str, name: str, *extra: str) -> ScriptRun:
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        return ScriptRun(SCRIPTS / "ft_trainer.py", ["--replica", replica, "--lighthouse", lighthouse.address(),
                                                      "--out", str(tmp_path / name), "--steps", str(STEPS),
                                                      "--step-seconds", "0.2", "--devices", "2", *extra],
                         tmp_path, env)

    try:  # (0.2 s steps: the replacement, 2 processes to start, joins well before group 0 ends)
        runs = [start(str(r), f"group{r}", *(["--die-at", "6"] if r == 1 else [])) for r in range(2)]
        code, output = runs[1].wait(timeout=120)
        assert code == 0, output[-3000:]
        time.sleep(2.0)
        replacement = start("1", "replacement")
        outcomes = [run.wait(timeout=180) for run in (runs[0], replacement)]
    finally:
        lighthouse.shutdown()
    for code, output in outcomes:
        assert code == 0, output[-4000:]
    names = ["group0", "group0-rank1", "replacement", "replacement-rank1"]
    results = [torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in names]
    for result in results:
        assert result["optimizer_steps"] == STEPS and result["syncs"] == STEPS // H and result["rollbacks"] == 0, result
        assert all(torch.equal(a, b) for a, b in zip(result["params"], results[0]["params"]))
    assert 1 in results[0]["participants"] and results[0]["participants"][-1] == 2, results[0]["participants"]
    assert results[2]["heals"] == 1 and results[2]["global_step"] < STEPS, "the replacement joined a running job"
    # each process of a group exchanges half of the model's rows: together one model (fp32) per synchronisation
    sent = [result["totals"].bytes_dense for result in results]
    model_bytes = 4 * sum(p.numel() for p in results[0]["params"])
    assert sent[0] + sent[1] == STEPS // H * model_bytes and abs(sent[0] - sent[1]) < 0.05 * sent[0], sent
    assert abs(sent[2] - sent[3]) < 0.05 * sent[2], sent  # (the replacement, over the synchronisations it joined)
    # the groups shuffle with their own seeds (the same seed inside a group, whose ranks split each epoch)
    seeds = [result["sampler_seed"] for result in results]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3], seeds


def _two_groups(script: str, tmp_path: Path, name: str, *args: str) -> list[tuple[int, str]]:
    """Two replica groups of ``script`` with ``args`` (their own ``MASTER_PORT`` each, ``--out`` tmp_path/<name><r>),
    joined by a lighthouse of ``min_replicas=2`` started here; their exit codes and outputs."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
    try:
        runs = [ScriptRun(SCRIPTS / script, ["--replica", str(r), "--lighthouse", lighthouse.address(), "--out",
                                             str(tmp_path / f"{name}{r}"), *args], tmp_path,
                          dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
                for r in range(2)]
        return [run.wait(timeout=180) for run in runs]
    finally:
        lighthouse.shutdown()


def test_trainer_groups_of_two_fsdp2_shards_exchange_their_shards(tmp_path: Path) -> None:
    """Two Trainers of ``GradCompFSDPStrategy(local_updates=4, fault_tolerance=...)`` on 2 processes each (the
    group's processes shard the model): every synchronisation committed with both groups, each rank's shard
    equal to the same rank's of the other group at the end; the summary reports the quorums."""
    pytest.importorskip("torchft")
    outcomes = _two_groups("ft_trainer.py", tmp_path, "fsdp", "--steps", "24", "--step-seconds", "0.02", "--devices",
                           "2", "--fsdp")
    for code, output in outcomes:
        assert code == 0, output[-4000:]
        assert "fault tolerance: 6 synchronisations, 6 committed" in output, output[-3000:]
    for rank in ("", "-rank1"):
        first, second = (torch.load(tmp_path / f"fsdp{r}{rank}.pt", weights_only=False) for r in range(2))
        for result in (first, second):
            assert result["syncs"] == 6 and result["participants"][-1] == 2, result
        assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))
        assert first["sampler_seed"] != second["sampler_seed"]
    halves = [torch.load(tmp_path / f"fsdp0{rank}.pt", weights_only=False)["params"] for rank in ("", "-rank1")]
    assert not all(torch.equal(a, b) for a, b in zip(*halves)), "the two ranks hold different shards"


def test_fabric_replica_groups_train_in_step_and_end_equal(tmp_path: Path) -> None:
    """Two Fabric jobs of ``devices=2`` (DDP inside each), ``GradCompFabricStrategy(local_updates=4,
    fault_tolerance=...)`` with SparseLoCo (top-k of each rank's row blocks): 5 synchronisations, every one
    committed with both groups, the same weights at the end on all four processes."""
    pytest.importorskip("torchft")
    outcomes = _two_groups("ft_fabric.py", tmp_path, "fabric", "--devices", "2")
    for code, output in outcomes:
        assert code == 0, output[-4000:]
    results = [torch.load(tmp_path / name, weights_only=False)
               for name in ("fabric0.pt", "fabric1.pt", "fabric0-rank1.pt", "fabric1-rank1.pt")]
    for result in results:
        assert result["syncs"] == 5 and result["commits"] == 5 and result["participants"][1:] == [2] * 5, result
        assert "fault tolerance: 5 synchronisations, 5 committed" in result["summary"]
        assert sum(result["losses"][-4:]) < 0.7 * sum(result["losses"][:4])
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], result["params"]))


def check_refusals(rank: int, world_size: int, unreachable: str) -> None:
    import sys
    from torch import nn

    import lightning_gradcomp
    from lightning_gradcomp import FaultTolerance

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = sys.modules.get("torchft")
    sys.modules["torchft"] = None  # type: ignore[assignment]  # as if not installed
    try:
        with pytest.raises(ValueError, match=r'pip install "lightning-gradcomp\[ft\]"'):
            lightning_gradcomp.local_updates(model, optimizer, 4, fault_tolerance=FaultTolerance(lighthouse=unreachable))
    finally:
        if saved is None:
            del sys.modules["torchft"]
        else:
            sys.modules["torchft"] = saved
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=unreachable.replace(".", r"\.")):
        lightning_gradcomp.local_updates(model, optimizer, 4, fault_tolerance=FaultTolerance(
            lighthouse=unreachable, quorum_timeout=3, connect_timeout=2, timeout=3))
    assert time.monotonic() - began < 30


def check_a_start_without_the_expected_groups(rank: int, world_size: int, lighthouse: str) -> None:
    from torch import nn

    import lightning_gradcomp
    from lightning_gradcomp import FaultTolerance

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    began = time.monotonic()
    with pytest.warns(UserWarning, match=r"1 of the 2 expected replica groups after start_timeout=1 s; training starts"):
        handle = lightning_gradcomp.local_updates(model, optimizer, 2, fault_tolerance=FaultTolerance(
            lighthouse=lighthouse, replica_id="alone", expected_groups=2, start_timeout=1, timeout=5, quorum_timeout=5))
    assert 1 <= time.monotonic() - began < 20
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert handle.fault_tolerance.participants == [1, 1] and handle.loop.outer.syncs == 1  # the join, one window
    handle.close()


def test_a_fresh_start_without_the_expected_groups_starts_after_its_timeout_and_says_so() -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1500)
    try:
        run_gloo(check_a_start_without_the_expected_groups, 1, lighthouse.address())
    finally:
        lighthouse.shutdown()


def test_refused_without_torchft_and_an_unreachable_lighthouse_is_named_before_training() -> None:
    pytest.importorskip("torchft")
    with pytest.raises(ValueError, match="lighthouse"):
        from lightning_gradcomp import FaultTolerance

        FaultTolerance(lighthouse="127.0.0.1:29510")
    for bad in (0, True, 2.0, "3"):
        with pytest.raises(ValueError, match=r"`FaultTolerance.expected_groups` must be None .* an int >= 1"):
            FaultTolerance(lighthouse="http://127.0.0.1:29510", expected_groups=bad)
    with pytest.raises(ValueError, match="`FaultTolerance.start_timeout` must be a finite number of seconds > 0"):
        FaultTolerance(lighthouse="http://127.0.0.1:29510", expected_groups=2, start_timeout=0)
    run_gloo(check_refusals, 1, f"http://127.0.0.1:{free_port()}")
    from lightning_gradcomp import GradCompFabricStrategy, GradCompStrategy

    ft = FaultTolerance(lighthouse="http://127.0.0.1:29510")
    for strategy in (GradCompStrategy, GradCompFabricStrategy):
        with pytest.raises(ValueError, match="allowed without local_updates: fault_tolerance=None"):
            strategy(fault_tolerance=ft)
        with pytest.raises(ValueError, match="must be None or a lightning_gradcomp.FaultTolerance"):
            strategy(local_updates=4, fault_tolerance="http://127.0.0.1:29510")
