"""Real multi-process runs for the tests: gloo process groups, Lightning and Fabric jobs, and the
constants of the digits runs that several test modules compare."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCRIPTS = Path(__file__).parent / "scripts"


#: ports the tests listen on: below the kernel's ephemeral range (32768-60999 on Linux), so that no client
#: socket of another process (gloo's, torchft's) can take one between its choice here and its bind
_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port free now on 127.0.0.1, outside the ephemeral range (see :data:`_PORTS`)."""
    import random

    draw = random.SystemRandom()  # not the random module's state, which forked processes share
    for _ in range(200):
        port = draw.randrange(_PORTS.start, _PORTS.stop)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


#: Imported once by the fork server that starts every :func:`run_gloo` process: a fresh interpreter
#: importing them costs about 7 s on 2 cores (Lightning's imports), paid once per session instead of
#: once per process.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "lightning_gradcomp", "lightning", "tests._processes",
                      "tests._gloo_workers"]


def run_gloo(fn: Callable[..., None], world_size: int = 2, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` real processes joined by a gloo group.

    The processes are forked from a fork server that has the package imported and has run nothing
    (fresh processes, as with spawn, without the interpreter start-up; their environment is the test
    process's when the fork server started). ``fn`` must be importable (module level). An assertion
    failing in any rank fails the test.
    """
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    mp.start_processes(_gloo_entry, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="forkserver")


def _bare_entry(rank: int, nprocs: int, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)
    fn(rank, nprocs, *args)


def run_processes(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes forked from the fork server, with no process
    group: ``fn`` makes its own (one world per replica group, as torchft's jobs are)."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    mp.start_processes(_bare_entry, args=(nprocs, fn, args), nprocs=nprocs, start_method="forkserver")


def _script_main(script: str, argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """In a process forked from the fork server: run ``script`` as ``__main__`` with ``argv``, in ``cwd``
    with ``env``, stdout and stderr (file descriptors 1 and 2, inherited by its own children) to ``log``."""
    os.setsid()  # its own process group: a timeout ends the script and the ranks it started
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # as a fresh interpreter would read it
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *argv]
    code = 0
    try:
        if script.endswith(".py"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` does
            runpy.run_path(script, run_name="__main__")
        else:  # python -m script
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):  # sys.exit("message"), as Python prints it
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported through the log and the exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ScriptRun:
    """A Python script (a path, or a module name: ``python -m``) run as a fresh ``python script args``
    would, but forked from the fork server (the package already imported: about 7 s less per run on 2
    cores). Processes the script starts itself (Lightning's other ranks) are fresh interpreters as usual.
    :meth:`wait` returns ``(exit code, stdout + stderr)``."""

    def __init__(self, script: "Path | str", args: list[str], cwd: Path, env: dict[str, str]) -> None:
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        self.command = [str(script), *args]
        handle, log = tempfile.mkstemp(prefix=".script.", suffix=".log", dir=cwd)
        os.close(handle)
        self.log = Path(log)
        self.process = multiprocessing.get_context("forkserver").Process(
            target=_script_main, args=(str(script), list(args), str(cwd), env, str(self.log)))
        self.process.start()

    def wait(self, timeout: float) -> tuple[int, str]:
        """Wait for the script and every process it started (Lightning's other ranks write their results
        after rank 0 may have exited), at most ``timeout`` seconds; whatever is left then, or when waiting
        is interrupted, is killed."""
        deadline = time.monotonic() + timeout
        try:
            while self.process.exitcode is None or self._group_alive():
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.command, timeout, self.log.read_text(errors="replace"))
                self.process.join(0.05)
                if self.process.exitcode is not None:
                    time.sleep(0.05)
        finally:
            self.kill()
        output = self.log.read_text(errors="replace")
        self.log.unlink(missing_ok=True)
        return self.process.exitcode, output

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """End the script and every process it started (nothing when they have all ended)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join()


def run_script(script: "Path | str", args: list[str], cwd: Path, env: dict[str, str],
               timeout: float) -> tuple[int, str]:
    """:class:`ScriptRun` to its end."""
    return ScriptRun(script, args, cwd, env).wait(timeout)


def run_job(script: "Path | str", args: list[str], cwd: Path, world: int, timeout: float = 240) -> tuple[list[int], str]:
    """Run ``script`` as ``world`` processes of one job, each forked from the fork server with ``LOCAL_RANK``
    0..world-1 and one ``MASTER_PORT`` (as a launcher starts them: Lightning and Fabric then start no processes
    of their own); every rank's exit code and their combined output. A rank that fails ends the others."""
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    runs = [ScriptRun(script, list(args), cwd, dict(base, LOCAL_RANK=str(rank))) for rank in range(world)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [run.process.exitcode for run in runs]
        if None not in codes or any(code not in (None, 0) for code in codes):
            break
        time.sleep(0.05)
    for run in runs:
        if run.process.exitcode is None:  # a rank failed (the others wait for it in a collective), or time ran out
            run.kill()
    outcomes = [run.wait(10) for run in runs]
    output = "\n".join(f"--- rank {rank} (exit {code})\n{text}" for rank, (code, text) in enumerate(outcomes))
    return [code for code, _ in outcomes], output


def run_lightning(tmp_path: Path, name: str, *args: str, timeout: float = 300,
                  script: str = "train_digits.py") -> tuple[list[dict], str]:
    """Run ``tests/scripts/<script>`` (a real multi-process Lightning or Fabric job) as the processes of one job
    forked from the fork server (:func:`run_job`: ``--devices`` of them, 2 by default, 1 with ``--simulate``;
    Lightning's launcher would start the other ranks as fresh interpreters, about 5 s each on 2 cores);
    return every rank's results and the combined output."""
    out = tmp_path / name
    world = 1 if "--simulate" in args else int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    codes, output = run_job(SCRIPTS / script, ["--out", str(out), *args], tmp_path, world, timeout)
    assert all(code == 0 for code in codes), output[-4000:]
    results = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob(f"{name}.rank*.pt"))]
    assert len(results) == world, output[-4000:]
    return results, output


#: The digits runs of tests/scripts/train_digits.py and fabric_digits.py.
EPOCHS = "10"
STEPS_PER_EPOCH = 22  # 1348 training images / 2 ranks / batch 32, rounded up


def params_equal(a: dict, b: dict) -> bool:
    """Two runs' final parameters, equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_torchrun(script: Path, cwd: Path, *args: str, nproc: int = 2, timeout: float = 300) -> str:
    """``python -m torch.distributed.run --nproc-per-node nproc script args`` on this host (a real torchrun:
    its agent starts fresh interpreters); the combined output, asserting it succeeded."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output
