"""The misuse probe (issue 46, item 7): every case of tests/_misuse_cases.py run in isolation and classified.

    python -m tests.misuse_probe [--json out.json] [--only WORD] [--parallel N] [--package DIR]

Classes (one per case):

* ``clear``: refused, on every rank that should refuse, with a message holding the case's phrases (it names
  the parameter or setting, and says what to do or which values are allowed);
* ``legit``: a legitimate use, accepted, and the case's own correctness check passed;
* ``vague``: refused, but the message lacks the phrases;
* ``silent``: no error where a refusal was expected, or a legitimate use whose check failed (it ran wrong);
* ``hang``: no answer within the case's timeout (a rank's Python stack, dumped before it is killed, is in
  the message);
* ``abort``: a process died (a signal, or an exit without a Python exception);
* ``refused_legit``: a legitimate use refused;
* ``n/a``: an API the case needs does not exist in the package under test (an older checkout).

How the cases run: a *hub* process that has imported torch, Lightning, the package and the cases, and has
computed nothing, forks every case's processes (``world`` of them, joined by a gloo group; single-process
cases get a group of one). Cases that cannot block one another share a job and run in turn, each on
fresh models (the ranks of a multi-process job meet on a TCP store the hub hosts, between cases, outside the
process group); a case that may hang or leave collectives pending (``isolated``) gets a job of its own, where
a rank whose case raised exits at once, as a script dying of the error would (the others' collectives with
it then fail instead of waiting for a process that would be gone). A job that
stops making progress past its current case's timeout, or whose process dies, is killed; that case is
classified ``hang`` or ``abort`` and the job's remaining cases run again in a new job. Under pytest the hub
is started from the suite's fork server (tests/_processes.py); from the command line this process is the
hub.

Against another checkout of the package (the "before" tally): run it from this repository's root with
``PYTHONPATH=/path/to/other/worktree`` (or ``--package /path/to/other/worktree``): the package is then
imported from there, and the cases and this runner from here.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]

#: every class, the good ones first (the order of the tally)
CLASSES = ("clear", "legit", "vague", "silent", "hang", "abort", "refused_legit", "n/a")
GOOD = frozenset({"clear", "legit"})
#: how much of a message a result keeps (the report shows less)
KEPT = 2000


@dataclass
class Result:
    """One case's outcome."""

    name: str
    area: str
    world: int
    expect: str
    cls: str
    message: str = ""
    seconds: float = 0.0
    #: per rank: status (ok / raised / check_failed / na / missing), exception type, message
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the ranks


class _Job:
    """A list of cases run in turn by ``world`` processes."""

    def __init__(self, names: list[str], world: int, env: dict[str, str], root: Path, serial: int) -> None:
        self.names, self.world, self.env = names, world, env
        self.dir = root / f"job{serial:03d}"
        self.dir.mkdir(parents=True)
        self.processes: list[Any] = []
        self.offsets = [0] * world
        self.done: list[dict[int, dict[str, Any]]] = [dict() for _ in range(world)]  # per rank: index -> record
        self.began = time.monotonic()
        self.current = -1  # the first case some rank has not finished
        self.since = 0.0  # when self.current became current
        self.store: Any = None  # the job's control store (hosted by the hub)


def _free_port() -> int:
    from tests._processes import free_port  # outside the ephemeral range: see there

    return free_port()


def _rank_main(names: list[str], rank: int, world: int, port: int, directory: str, env: dict[str, str]) -> None:
    """One rank of a job: every case in turn, a record per case in ``rank<r>.jsonl``."""
    import faulthandler

    log = os.open(os.path.join(directory, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    os.environ.update(env)
    # the process group's store is the control store (torchft's managers find it at MASTER_ADDR:MASTER_PORT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from tests import _misuse_cases as cases

    torch.set_num_threads(1)
    gc.freeze()  # what the hub imported is never collected: each case's gc.collect() scans its own objects only
    control = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(hours=1))  # the hub's
    events = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", buffering=1)
    inits = 0
    for index, name in enumerate(names):
        case = cases.BY_NAME[name]
        if not dist.is_initialized():  # each case gets a fresh group of the job's ranks
            store = dist.PrefixStore(f"pg{inits}", control)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            inits += 1
        try:
            record = cases.run_case(case, rank, world)
        except BaseException as error:  # noqa: BLE001 - the probe's own failure, shown as the case's
            record = {"status": "raised", "type": type(error).__name__, "message": f"(in the probe) {error}"}
        record["message"] = record.get("message", "")[:KEPT]
        if index + 1 < len(names) and dist.is_initialized():
            # the next case starts from a fresh group (torch's count of groups made, which names the next one,
            # back at zero on every rank, whatever this case made); a teardown that hangs is this case's
            dist.destroy_process_group()
        events.write(json.dumps({"done": index, **record}) + "\n")
        if world > 1:
            control.set(f"case{index}/rank{rank}", "done")
            if case.isolated and record["status"] == "raised":
                break  # a job of its own: this rank dies of the error, as a script would (its sockets close)
            control.wait([f"case{index}/rank{r}" for r in range(world)])  # every rank is done before the next
    events.write(json.dumps({"end": True}) + "\n")
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: threads a case left (torchft, exchange threads) cannot hold the exit


# ---------------------------------------------------------------------------------------------- the hub


def _jobs(names: list[str]) -> list[tuple[list[str], int, dict[str, str]]]:
    """The jobs of ``names``: one per isolated case, one per (world, environment) for the others."""
    from tests import _misuse_cases as cases

    shared: dict[tuple[int, tuple[tuple[str, str], ...]], list[str]] = {}
    jobs = []
    for name in names:
        case = cases.BY_NAME[name]
        if case.isolated:
            jobs.append(([name], case.world, dict(case.env)))
        else:
            shared.setdefault((case.world, tuple(sorted(case.env.items()))), []).append(name)
    # the shared jobs first (the longest), the single-process one split in two (two cores)
    first = []
    for (world, env), members in sorted(shared.items(), key=lambda item: -len(item[1])):
        parts = 2 if world == 1 and len(members) > 8 else 1
        for part in range(parts):
            first.append((members[part::parts], world, dict(env)))
    return first + jobs


def _read(job: _Job) -> None:
    for rank in range(job.world):
        path = job.dir / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        with open(path) as handle:
            handle.seek(job.offsets[rank])
            text = handle.read()
        complete = text[: text.rfind("\n") + 1]
        job.offsets[rank] += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            if "done" in event:
                job.done[rank][event.pop("done")] = event


def _first_unfinished(job: _Job) -> int:
    return min(next((i for i in range(len(job.names)) if i not in done), len(job.names)) for done in job.done)


def _log_tail(job: _Job, rank: int, chars: int = 1500) -> str:
    path = job.dir / f"rank{rank}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _stack_of(dump: str) -> str:
    """The innermost frames of the main thread's stack in a faulthandler dump (where a rank waits)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    main = [b for b in blocks if b.startswith("Current thread")] or blocks[-1:]
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main[-1] if main else "")
    shown = [f"{Path(path).name}:{line} {function}" for path, line, function in frames
             if not path.endswith(("misuse_probe.py", "threading.py"))][:4]
    return " <- ".join(shown)


def _kill(job: _Job, dump: bool) -> dict[int, str]:
    """End ``job``'s processes; with ``dump``, first each live rank's Python stack (faulthandler)."""
    stacks: dict[int, str] = {}
    alive = [(rank, p) for rank, p in enumerate(job.processes) if p.exitcode is None]
    if dump and alive:
        before = {rank: len(_log_tail(job, rank, 10**7)) for rank, _ in alive}
        for _, process in alive:
            try:
                os.kill(process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        for rank, _ in alive:
            stacks[rank] = _stack_of(_log_tail(job, rank, 10**7)[before[rank]:])
    for _, process in alive:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in job.processes:
        process.join()
    return stacks


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_cases(names: Optional[list[str]] = None, parallel: int = 6, verbose: bool = False,
              root: Optional[Path] = None, keep: bool = False) -> dict[str, Result]:
    """Run the cases ``names`` (default: all) and classify each; in the calling process, which must have
    computed nothing with torch (it forks the ranks). The ranks' logs are in a temporary directory under
    ``root``, removed at the end unless ``keep``."""
    from tests import _misuse_cases as cases

    cases.preload()
    names = list(cases.BY_NAME) if names is None else names
    root = Path(tempfile.mkdtemp(prefix="misuse-probe-", dir=root))
    pending = _jobs(names)
    running: list[_Job] = []
    results: dict[str, Result] = {}
    try:
        _drive(pending, running, results, root, verbose, parallel)
    finally:
        for job in running:  # an interruption: nothing is left behind
            _kill(job, dump=False)
        if keep:
            print(f"the ranks' logs: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return {name: results[name] for name in names}


def _drive(pending: list[tuple[list[str], int, dict[str, str]]], running: list[_Job], results: dict[str, Result],
           root: Path, verbose: bool, parallel: int) -> None:
    """Start the jobs of ``pending``, at most ``parallel`` at once, and classify every case as they end."""
    import multiprocessing

    import torch.distributed as dist

    from tests import _misuse_cases as cases

    fork = multiprocessing.get_context("fork")
    serial = 0

    def finish(job: _Job, index: int, fate: Optional[tuple[str, str]] = None) -> None:
        name = job.names[index]
        records = {rank: job.done[rank].get(index, {"status": "missing"}) for rank in range(job.world)}
        result = classify(cases.BY_NAME[name], records, fate)
        results[name] = result
        if verbose:
            print(f"  {result.cls:13s} {result.seconds:5.1f}s {name}", flush=True)

    def start(names_: list[str], world: int, env: dict[str, str]) -> None:
        nonlocal serial
        job = _Job(names_, world, env, root, serial)
        serial += 1
        port = _free_port()
        # the job's control store lives here, so that a rank may exit while the others finish the case
        job.store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(hours=1),
                                  wait_for_workers=False)
        job.processes = [fork.Process(target=_rank_main, args=(names_, rank, world, port, str(job.dir), env))
                         for rank in range(world)]
        for process in job.processes:
            process.start()
        job.since = time.monotonic()
        running.append(job)

    while pending or running:
        while pending and len(running) < parallel:
            start(*pending.pop(0))
        time.sleep(0.05)
        for job in list(running):
            _read(job)
            current = _first_unfinished(job)
            if current != job.current:
                job.current, job.since = current, time.monotonic()
            exited = [p.exitcode for p in job.processes]
            if current >= len(job.names):  # every case finished on every rank
                if all(code is not None for code in exited) or time.monotonic() - job.since > 10:
                    _kill(job, dump=False)
                    running.remove(job)
                    if verbose:
                        seconds = time.monotonic() - job.began
                        print(f"job of {len(job.names)} case(s) x {job.world} proc: {seconds:.1f} s", flush=True)
                    for index in range(len(job.names)):
                        finish(job, index)
                continue
            case = cases.BY_NAME[job.names[current]]
            # a rank killed by a signal first: the others may have died of losing it
            died = sorted([(rank, code) for rank, code in enumerate(exited) if code is not None and code != 0],
                          key=lambda item: (item[1] > 0, item[0]))
            ended = [(rank, code) for rank, code in enumerate(exited) if code == 0 and current not in job.done[rank]]
            waited = time.monotonic() - job.since
            if not died and not ended and waited <= case.timeout:
                continue
            stacks = _kill(job, dump=not died)
            running.remove(job)
            if died:
                rank, code = died[0]
                tail = _log_tail(job, rank).strip().splitlines()[-6:]
                fate = ("abort", f"rank {rank} died ({_exit_text(code)}) in the case; its last output: "
                                 + " | ".join(tail))
            elif ended:
                fate = ("abort", f"rank {ended[0][0]} exited (code 0) before the case finished")
            else:
                stuck = [rank for rank in range(job.world) if current not in job.done[rank]]
                where = "; ".join(f"rank {rank} in {stacks.get(rank) or '?'}" for rank in stuck)
                if not stuck:
                    where = "every rank finished the case, but they never met after it (collectives left pending)"
                for rank in range(job.world):
                    record = job.done[rank].get(current)
                    if record is not None:
                        said = " ".join(f"{record.get('type', '')} {record.get('message', '')}".split())[:160]
                        where += f"; rank {rank} finished ({record['status']}{': ' + said if said else ''})"
                fate = ("hang", f"no answer within {case.timeout:g} s: {where}")
            for index in range(current):
                finish(job, index)
            finish(job, current, fate)
            if current + 1 < len(job.names):
                pending.insert(0, (job.names[current + 1:], job.world, job.env))


# ---------------------------------------------------------------------------------------------- classification


def matches(phrases: tuple[str, ...], message: str) -> list[str]:
    """The phrases (regular expressions, case-insensitive) that ``message`` lacks."""
    return [phrase for phrase in phrases if not re.search(phrase, message, re.IGNORECASE | re.DOTALL)]


def classify(case: Any, records: dict[int, dict[str, Any]], fate: Optional[tuple[str, str]] = None) -> Result:
    """The class of ``case`` from every rank's record (``status``: ok, raised, check_failed, na; ``missing``
    when the rank never finished it) and the job's fate (``("hang" | "abort", why)`` when it was killed)."""
    seconds = max((record.get("seconds", 0.0) for record in records.values()), default=0.0)
    result = Result(case.name, case.area, case.world, case.expect, "", "", round(seconds, 2),
                    {str(rank): record for rank, record in records.items()})

    def verdict(cls: str, message: str) -> Result:
        result.cls, result.message = cls, message
        return result

    if fate is not None:
        return verdict(*fate)
    statuses = {rank: record["status"] for rank, record in records.items()}
    if any(status == "na" for status in statuses.values()):
        return verdict("n/a", next(r["message"] for r in records.values() if r["status"] == "na"))
    failed = [rank for rank, status in statuses.items() if status == "check_failed"]
    if failed:
        return verdict("silent", f"rank {failed[0]}: {records[failed[0]]['message']}")
    refusing = case.refusing if case.refusing is not None else tuple(range(case.world))

    def refusal(rank: int) -> str:
        record = records[rank]
        return f"{record.get('type', '')}: {record.get('message', '')}"

    if case.expect == "refused":
        accepted = [rank for rank in refusing if statuses[rank] == "ok"]
        if accepted:
            ranks = ", ".join(map(str, accepted))
            note = records[accepted[0]].get("message") or "no error, no warning"
            return verdict("silent", f"accepted on rank(s) {ranks}: {note}")
        for rank in refusing:
            if matches(case.phrases, refusal(rank)):
                return verdict("vague", f"rank {rank}: {refusal(rank)}")
        return verdict("clear", refusal(refusing[0]))
    raised = [rank for rank, status in statuses.items() if status == "raised"]
    if not raised:
        return verdict("legit", "")
    message = refusal(raised[0])
    if not case.refusal_ok:
        return verdict("refused_legit", f"rank {raised[0]}: {message}")
    for rank in raised:  # a use the package may support or refuse: a refusal must be clear
        if matches(case.refusal_ok, refusal(rank)):
            return verdict("vague", f"rank {rank}: {refusal(rank)}")
    return verdict("clear", message)


def tally(results: dict[str, Result]) -> dict[str, int]:
    counts = {cls: 0 for cls in CLASSES}
    for result in results.values():
        counts[result.cls] += 1
    return {cls: count for cls, count in counts.items() if count or cls in GOOD}


def report(results: dict[str, Result], width: int = 200) -> str:
    """The tally table, then every case that is neither clear nor legit with its message."""
    counts = tally(results)
    single = sum(1 for r in results.values() if r.world == 1)
    lines = [f"misuse probe: {len(results)} cases ({single} single-process, {len(results) - single} multi-process)",
             "", f"{'class':14s} {'cases':>5s}", f"{'-' * 14} {'-' * 5}"]
    lines += [f"{cls:14s} {count:5d}" for cls, count in counts.items()]
    bad = [r for r in results.values() if r.cls not in GOOD]
    if bad:
        lines += ["", "not clear / legit:"]
        for result in sorted(bad, key=lambda r: (CLASSES.index(r.cls), r.name)):
            message = " ".join(result.message.split())
            lines.append(f"- [{result.cls}] {result.name} ({result.area}, {result.world} proc): {message[:width]}")
    return "\n".join(lines)


def to_json(results: dict[str, Result]) -> dict[str, Any]:
    return {"tally": tally(results), "cases": {name: asdict(result) for name, result in results.items()}}


# ---------------------------------------------------------------------------------------------- from pytest


def _hub_entry(names: Optional[list[str]], out: str, parallel: int) -> None:
    try:
        results = run_cases(names, parallel=parallel, root=Path(out).parent)
        Path(out).write_text(json.dumps(to_json(results)))
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_from_the_suite(out: Path, names: Optional[list[str]] = None, parallel: int = 6,
                       timeout: float = 600) -> dict[str, Result]:
    """:func:`run_cases` in a hub forked from the suite's fork server (the test process has computed with
    torch, so it cannot fork the ranks itself)."""
    import multiprocessing

    from tests._processes import FORKSERVER_PRELOAD

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    hub = multiprocessing.get_context("forkserver").Process(target=_hub_entry, args=(names, str(out), parallel))
    hub.start()
    hub.join(timeout)
    if hub.exitcode is None:
        hub.kill()
        hub.join()
        raise TimeoutError(f"the misuse probe's hub did not finish within {timeout} s")
    data = json.loads(out.read_text())
    if "error" in data:
        raise RuntimeError(f"the misuse probe's hub failed:\n{data['error']}")
    return {name: Result(**fields) for name, fields in data["cases"].items()}


# ---------------------------------------------------------------------------------------------- command line


def _use_package(directory: Optional[str]) -> None:
    """Import ``lightning_gradcomp`` from ``directory`` (or from the first ``PYTHONPATH`` entry that holds one
    other than this repository's), the cases and the runner from this repository."""
    candidates = [directory] if directory else os.environ.get("PYTHONPATH", "").split(os.pathsep)
    for entry in candidates:
        if entry and (Path(entry) / "lightning_gradcomp" / "__init__.py").exists() and Path(entry).resolve() != REPO:
            # ``tests`` is already imported from here; the repository root must not shadow the other package
            sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
            sys.path.insert(0, str(Path(entry).resolve()))
            return
    if directory:
        raise SystemExit(f"--package {directory}: no lightning_gradcomp package there")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.misuse_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every case's result there")
    parser.add_argument("--only", action="append", help="run the cases whose name or area holds this word")
    parser.add_argument("--parallel", type=int, default=6, help="jobs at once (default 6)")
    parser.add_argument("--package", help="import lightning_gradcomp from this directory (default: PYTHONPATH's)")
    parser.add_argument("--verbose", action="store_true", help="a line per case and per job as they end")
    parser.add_argument("--keep", action="store_true", help="keep the ranks' logs (the directory is printed)")
    args = parser.parse_args(argv)
    _use_package(args.package)
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    import lightning_gradcomp

    from tests import _misuse_cases as cases

    print(f"lightning_gradcomp from {Path(lightning_gradcomp.__file__).parent}", flush=True)
    names = [name for name, case in cases.BY_NAME.items()
             if not args.only or any(word in name or word == case.area for word in args.only)]
    began = time.monotonic()
    results = run_cases(names, parallel=args.parallel, verbose=args.verbose, keep=args.keep)
    print(report(results))
    print(f"\n{len(results)} cases in {time.monotonic() - began:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
