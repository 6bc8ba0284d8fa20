"""A peer that exits, is killed or hangs ends the other rank with an error that names the failed
collective and the rank, within the process group's timeout: real gloo processes, one all-reduce
compressor (``none``), one all-gather compressor (``topk``, every tensor compressed, so the bucket's
only collective is the all-gather) and the int8 quantised all-reduce (an all-to-all first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._processes import SCRIPTS, ScriptRun, free_port, run_script

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "dead_peer.py"
TIMEOUT = 5.0


CASES = [(compressor, collective, fault, False) for compressor, collective in (("none", "all_reduce"),
                                                                               ("topk", "all_gather"))
         for fault in ("exit", "kill", "hang")]
CASES += [("topk", "all_gather", "kill", True), ("none", "all_reduce", "hang", True)]  # on the exchange thread
CASES += [("int8", "all_to_all", "kill", False)]  # a multi-round protocol fails in its first, intermediate round
# local updates: the peer dies inside a window, the survivor fails at the next outer synchronisation
LOCAL_CASES = [("topk", "all_gather", "kill")]


@pytest.mark.parametrize("compressor,collective,fault,thread", CASES)
def test_a_failed_peer_is_an_error_naming_the_collective(compressor: str, collective: str, fault: str,
                                                         thread: bool, tmp_path: Path) -> None:
    _check_failure(compressor, collective, fault, ["--thread"] if thread else [], tmp_path)


@pytest.mark.parametrize("compressor,collective,fault", LOCAL_CASES)
def test_a_peer_dead_at_an_outer_synchronisation_is_an_error(compressor: str, collective: str, fault: str,
                                                             tmp_path: Path) -> None:
    _check_failure(compressor, collective, fault, ["--local", "2"], tmp_path)


def test_a_peer_dead_at_an_outer_synchronisation_of_sharded_local_updates_is_an_error(tmp_path: Path) -> None:
    """2 replicas x 2 FSDP2 shards: rank 3 is killed inside a window; rank 0, whose replica partner (rank 2)
    fails at FSDP's next collective with rank 3, ends with the CollectiveError of its own exchange."""
    _check_failure("topk", "all_gather", "kill", ["--local", "2", "--fsdp"], tmp_path, world=4)


def _check_failure(compressor: str, collective: str, fault: str, extra: list[str], cwd: Path, world: int = 2) -> None:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [ScriptRun(SCRIPT, ["--rank", str(rank), "--port", str(port), "--compressor", compressor, "--fault", fault,
                                "--timeout", str(TIMEOUT), "--min-compress-numel", "0", *extra], cwd, env)
             for rank in range(world)]
    try:
        code, output = ranks[0].wait(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
    assert code == 3, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("FAILED"))
    seconds, kind = float(line.split()[1]), line.split()[2]
    assert f"gradcomp: {collective}" in line and "failed on rank 0 of 2" in line, line
    assert kind == "CollectiveError", line
    assert seconds < TIMEOUT + 10, f"the failure took {seconds} s with a {TIMEOUT} s timeout"


def test_a_dead_peer_ends_a_lightning_fit_with_collective_error(tmp_path: Path) -> None:
    """The Trainer's rank 0 sees the exchange's own error type (DDP's backward would wrap it in a
    RuntimeError), soon after rank 1 exits (gloo notices a closed connection at once)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code, output = run_script(SCRIPTS / "train_digits.py", ["--out", str(tmp_path / "dead"), "--epochs", "1",
                                                           "--peer-dies-at-step", "3"], tmp_path, env, timeout=120)
    assert code == 3, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("COLLECTIVE_ERROR"))
    assert line.startswith("COLLECTIVE_ERROR gradcomp: ") and "failed on rank 0 of 2" in line, line
