"""The compression state in Lightning checkpoints: one entry per worker, restored on resume.

Both strategies write ``checkpoint["gradcomp"] = {"version", "world_size", "compressor", "ranks"}``,
where ``ranks[i]`` is worker ``i``'s memory (residuals, compressor state), step and running totals. A
real N-process run and an N-worker simulation write the same format.

A rank's *part* (:func:`own_entry`) is the same format with only that rank's slot of ``ranks`` filled
(``None`` elsewhere) and ``"part"`` naming the rank: made without a collective, saved and loaded by each
rank itself (:func:`save_part`, :func:`load_part`: the Trainer's and Fabric's strategies' checkpoints), so
that no rank holds every rank's residuals and replicas, whatever the number of ranks.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.agreement import check_agreement
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.tally import CollectiveTally

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradcomp"
VERSION = 1
#: how long a plain handle's ``state_dict()`` waits for the other ranks by default
DEFAULT_CHECKPOINT_TIMEOUT = timedelta(minutes=5)


def pack(world_size: int, compressor: Compressor, ranks: list[dict[str, Any]], layout: str = "flat") -> dict[str, Any]:
    """The checkpoint entry for the per-worker states ``ranks`` (``layout``: ``"flat"`` or the hierarchical
    exchange's ``"nodes=M,local=L"``; entries written before it existed are flat)."""
    return {"version": VERSION, "world_size": world_size, "compressor": type(compressor).__name__, "ranks": ranks,
            "layout": layout}


def gather_entry(hook_state: Any, compressor: Compressor, local: Optional[dict[str, Any]] = None,
                 group: Optional[dist.ProcessGroup] = None) -> Optional[dict[str, Any]]:
    """Collective over ``hook_state``'s ``checkpoint_group`` (``hook_state``: an
    :class:`~lightning_gradcomp.exchange.session.ExchangeSession`, typed loosely since the session imports this
    module): every rank's state, packed on the group's first rank (``None`` on the others); ``local``: this
    rank's local-update state, kept as its ``"local"``. Every rank of the group must call it. The states travel
    over a gloo group of the same ranks, not through GPU memory
    (:meth:`~lightning_gradcomp.exchange.session.ExchangeSession.gather_group`, or ``group``: the plain
    handles' own, see :func:`checkpoint_group`).

    Raises:
        CheckpointTimeout: ``group`` was given and the other ranks did not join within its timeout (a
            script that calls ``state_dict()`` on rank 0 only).
    """
    gather_group = group if group is not None else hook_state.gather_group()
    world_size, rank = dist.get_world_size(gather_group), dist.get_rank(gather_group)
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    destination = dist.get_global_rank(gather_group, 0) if gather_group is not None else 0
    state = {**hook_state.state_dict(), **({"local": local} if local is not None else {})}
    try:
        dist.gather_object(state, gathered, dst=destination, group=gather_group)
    except RuntimeError as error:
        if group is None:
            raise
        if "timed out" not in str(error).lower():  # a peer gone, not one that never came
            raise RuntimeError(
                f"gradcomp: state_dict()'s gather failed on rank {dist.get_rank()}: a peer died, or an earlier "
                "state_dict() called on some ranks only timed out and left the gathers out of step (restart the "
                f"run with state_dict() called on every rank). ({' '.join(str(error).split())[:300]})") from error
        raise CheckpointTimeout(CHECKPOINT_TIMEOUT_ADVICE.format(rank=dist.get_rank(), timeout=_timeout_of(group),
                                                                 error=" ".join(str(error).split())[:300])) from error
    return pack(world_size, compressor, gathered, hook_state.layout) if gathered is not None else None


def own_entry(hook_state: Any, compressor: Compressor, rank: int, world_size: int,
              local: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """This rank's part of the checkpoint entry (see the module's docstring), with no collective. ``rank`` and
    ``world_size``: this rank's position among the entry's workers; ``local``: as for :func:`gather_entry`."""
    ranks: list[Optional[dict[str, Any]]] = [None] * world_size
    ranks[rank] = {**hook_state.state_dict(), **({"local": local} if local is not None else {})}
    return {**pack(world_size, compressor, ranks, hook_state.layout), "part": rank}


def parts_stub(part: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint itself holds under ``"gradcomp"`` when each rank keeps its part (``part``: this
    rank's) in a file of its own: no state, the number of parts and the exchange's step when they were
    written, so that a load finds them, says they are missing, or refuses parts of another save."""
    return {"version": part["version"], "parts": part["world_size"], "world_size": part["world_size"],
            "compressor": part["compressor"], "layout": part.get("layout", "flat"), "step": _part_step(part)}


def is_parts_stub(entry: Any) -> bool:
    return isinstance(entry, dict) and "parts" in entry and "ranks" not in entry


def _part_step(part: dict[str, Any]) -> int:
    return int(part["ranks"][part["part"]].get("step", 0))


def part_file(checkpoint: Any, rank: int) -> Path:
    """Where global rank ``rank`` keeps its part of the checkpoint written at ``checkpoint``: in its directory
    (a sharded checkpoint), else beside its file, as ``<checkpoint>.gradcomp/rank<rank>.pt``. The path as
    given, links not followed: a link (``ModelCheckpoint(save_last="link")``'s ``last.ckpt``) has no parts of
    its own, and saving or removing through it must not touch its target's (:func:`load_part` follows it)."""
    checkpoint = Path(checkpoint).absolute()
    folder = checkpoint / "gradcomp" if checkpoint.is_dir() else Path(f"{checkpoint}.gradcomp")
    return folder / f"rank{rank:05d}.pt"


def agree_on_the_save(checkpoint: Any, group: Optional[dist.ProcessGroup], caller: str) -> None:
    """Before the parts are written: every rank of the exchange saves the same checkpoint (a bounded
    collective: a save called on some ranks only raises
    :class:`~lightning_gradcomp.exchange.waits.WaitTimeout` naming the absent ranks, instead of waiting in the
    checkpoint's own barrier for the process group's timeout; ranks saving under different paths, which
    would scatter the parts, raise :class:`~lightning_gradcomp.exchange.agreement.SettingsMismatch`)."""
    check_agreement({"checkpoint path": str(checkpoint)}, group, caller=caller)


def save_part(checkpoint: Any, rank: int, part: dict[str, Any]) -> None:
    """Write this rank's part (:func:`own_entry`) of ``checkpoint``, after the checkpoint itself is written (a
    sharded checkpoint's directory then exists). Every rank writes its own file: nothing is gathered."""
    path = part_file(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(part, path)


def remove_part(checkpoint: Any, rank: int) -> None:
    """Delete this rank's part of ``checkpoint`` (a checkpoint callback removing an old checkpoint; a link's
    target keeps its parts), and the parts' folder once it is empty."""
    path = part_file(checkpoint, rank)
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # other ranks' parts still there, or already removed
        pass


def _parts_to_read(checkpoint: Any) -> Path:
    """The checkpoint whose parts a load reads: ``checkpoint`` itself, or through a link its target."""
    return checkpoint if part_file(checkpoint, 0).parent.is_dir() else Path(checkpoint).resolve()


def has_parts(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` (or, through a link, its target) has a folder of parts."""
    return part_file(_parts_to_read(checkpoint), 0).parent.is_dir()


def load_part(checkpoint: Any, rank: int, world_size: int) -> Optional[dict[str, Any]]:
    """This rank's part of ``checkpoint``'s exchange state (through a link: its target's), ``None`` when the
    checkpoint has no parts. A checkpoint of fewer ranks has none for the ranks beyond them: those ranks
    read the first rank's part, whose ``world_size`` then differs from the run's, so that every rank keeps
    the counters only, with the warning :func:`restore_entry` gives. A part missing from a checkpoint of as
    many ranks is refused."""
    path = part_file(_parts_to_read(checkpoint), rank)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    present = sorted(path.parent.glob("rank*.pt")) if path.parent.is_dir() else []
    if not present:
        return None
    first = torch.load(present[0], map_location="cpu", weights_only=False)
    if first.get("world_size") == world_size:
        raise FileNotFoundError(f"gradcomp: {path} is missing: the checkpoint was written by {world_size} ranks, "
                                f"each with its part of the exchange state in {path.parent}, and only {len(present)} "
                                "parts are there (copy the checkpoint with its gradcomp folder)")
    return first


def resolve_entry(entry: Optional[dict[str, Any]], checkpoint: Any, rank: int,
                  world_size: int) -> Optional[dict[str, Any]]:
    """The entry to restore on global rank ``rank`` from what a checkpoint holds under ``"gradcomp"``: an entry
    of every rank (written before the parts, or by the simulation) as it is; a :func:`parts_stub`, this rank's
    part, read from its file (refused, with the reason, when the parts are not there, or when this rank's
    was written by another save than the checkpoint's)."""
    if not is_parts_stub(entry):
        return entry
    part = load_part(checkpoint, rank, world_size)
    if part is None:
        folder = part_file(checkpoint, rank).parent
        raise FileNotFoundError(
            f"gradcomp: the checkpoint {checkpoint} keeps its exchange state (residuals; under local updates each "
            f"rank's replica and the outer state) in one file per rank, in {folder}, which is not there: copy the "
            "checkpoint with that folder. To resume without it (residuals from zero, local updates restarting "
            "their window from the saved model), delete checkpoint['gradcomp'] from the checkpoint first")
    if "step" in entry and part.get("world_size") == entry["world_size"] and _part_step(part) != entry["step"]:
        raise ValueError(
            f"gradcomp: rank {rank}'s part of the exchange state in {part_file(checkpoint, rank).parent} was written at "
            f"exchange step {_part_step(part)}, the checkpoint at step {entry['step']}: the parts belong to another save "
            "(a checkpoint overwritten or copied over another one). Resume from a checkpoint whose folder was written "
            "with it, or delete checkpoint['gradcomp'] to resume without the exchange state")
    return part


def resolve_entry_on_every_rank(entry: Optional[dict[str, Any]], checkpoint: Any, rank: int, world_size: int,
                                group: Optional[dist.ProcessGroup], caller: str) -> Optional[dict[str, Any]]:
    """:func:`resolve_entry`, with the ranks agreeing on the outcome first (a bounded collective): a part missing
    or refused on some ranks only is an error on every rank, naming each rank's outcome, instead of one rank
    raising while the others wait for it in the next collective."""
    try:
        resolved, outcome, failure = resolve_entry(entry, checkpoint, rank, world_size), "read", None
    except (FileNotFoundError, ValueError) as error:
        resolved, outcome, failure = None, f"refused: {' '.join(str(error).split())[:300]}", error
    if is_parts_stub(entry):
        check_agreement({"checkpoint parts": outcome}, group, caller=caller)
    if failure is not None:
        raise failure
    return resolved


def gather_parts(checkpoint: Any) -> dict[str, Any]:
    """Every rank's part of ``checkpoint``'s exchange state, merged into one entry of every rank (the format of
    :meth:`~lightning_gradcomp.exchange.handle.ExchangeHandle.state_dict`): to inspect a checkpoint offline.
    Reads every part into this process's memory."""
    folder = part_file(_parts_to_read(checkpoint), 0).parent
    parts = [torch.load(path, map_location="cpu", weights_only=False) for path in sorted(folder.glob("rank*.pt"))]
    if not parts:
        raise FileNotFoundError(f"gradcomp: no parts of {checkpoint}'s exchange state in {folder}")
    merged = {key: value for key, value in parts[0].items() if key != "part"}
    merged["ranks"] = [None] * parts[0]["world_size"]
    for part in parts:
        merged["ranks"][part["part"]] = part["ranks"][part["part"]]
    return merged


class CheckpointTimeout(RuntimeError):
    """A plain handle's ``state_dict()`` waited longer than its ``timeout`` for the other ranks."""


CHECKPOINT_TIMEOUT_ADVICE = (
    "gradcomp: state_dict() on rank {rank} waited {timeout} for the other ranks and gave up. It is a "
    "collective: every rank gathers its residuals (and local-update replicas) on rank 0, so every rank must "
    "call it at the same point. In a script that saves on rank 0 only, call it on every rank first: "
    "`entry = handle.state_dict()` (None off rank 0), then `if rank == 0: torch.save({{..., 'gradcomp': "
    "entry}}, path)`. If the ranks reach the checkpoint further apart than that, raise `timeout=` of "
    "register() / local_updates(). ({error})")


#: the checkpoint groups made so far, by (default group, ranks, timeout): a process that registers several
#: models (or one again) reuses the group instead of making (and keeping) one per handle
_CHECKPOINT_GROUPS: dict[tuple[Any, Optional[tuple[int, ...]], timedelta], dist.ProcessGroup] = {}


def checkpoint_group(group: Optional[dist.ProcessGroup], timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks (``None``: the world) for the plain handles' checkpoint gathers,
    with its own ``timeout``: a ``state_dict()`` called on some ranks only raises
    :class:`CheckpointTimeout` after ``timeout`` instead of hanging for the training group's timeout. Every
    rank of ``group`` calls it at the same point (``register()``, ``local_updates()``). The same ranks and
    timeout get the same group again (until :func:`forget_checkpoint_group`)."""
    world = group is None or group is dist.group.WORLD
    ranks = None if world else dist.get_process_group_ranks(group)
    key = (dist.distributed_c10d._get_default_group(), None if ranks is None else tuple(ranks), timeout)
    made = _CHECKPOINT_GROUPS.get(key)
    if made is None:
        made = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=not world)
        _CHECKPOINT_GROUPS[key] = made
    return made


def forget_checkpoint_group(group: Optional[dist.ProcessGroup] = None) -> None:
    """Make :func:`checkpoint_group` build a new group instead of ``group`` (one whose gathers went out of step
    after a timeout), or instead of any (``None``: at exit)."""
    for key, made in list(_CHECKPOINT_GROUPS.items()):
        if group is None or made is group:
            del _CHECKPOINT_GROUPS[key]


def check_checkpoint_timeout(timeout: Any) -> timedelta:
    """``timeout`` as a ``timedelta``: a positive ``timedelta`` or number of seconds."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"`timeout` must be a positive timedelta or number of seconds (how long a collective "
                         f"state_dict() waits for the other ranks), got {timeout!r}")
    return timeout


def _timeout_of(group: dist.ProcessGroup) -> str:
    try:
        return f"{group._get_backend(torch.device('cpu')).options._timeout.total_seconds():g} s"
    except Exception:  # noqa: BLE001 - the backend does not say: the message stays useful without it
        return "its timeout"


def restore_entry(saved: dict[str, Any], hook_state: Any, workers: int, compressor: Compressor,
                  load_worker_states: Callable[[list[dict[str, Any]]], None], rank: Optional[int] = None) -> None:
    """Apply a checkpoint entry: every worker's own state when the run has the same number of workers,
    the same compressor and the same exchange layout; otherwise keep only the step counter, the
    running totals and the log of collectives (so a summary prices every step), with a warning that
    says what is dropped. A rank's part (:func:`own_entry`) is refused on another rank (``rank``: the
    loading rank's position)."""
    check_format(saved)
    name = type(compressor).__name__
    layout = getattr(hook_state, "layout", "flat")
    if saved["world_size"] != workers or saved["compressor"] != name or saved.get("layout", "flat") != layout:
        _warn_on_first_rank(describe_dropped(saved, workers, name, layout))
        states = saved_states(saved)
        hook_state.restore_counters(max(int(state.get("step", 0)) for state in states), mean_totals(states),
                                    CollectiveTally.from_state_dict(states[0].get("collectives")))
        return
    part = saved.get("part")
    if part is not None and rank is not None and part != rank:
        raise ValueError(f"gradcomp: this entry is rank {part}'s part of the exchange state, loaded on rank {rank}: "
                         "each rank loads its own part (rank_state_dict() on each rank, saved per rank)")
    load_worker_states(saved["ranks"])
    logger.info("gradcomp: restored the compression memory of %d workers of %s (layout %s)", workers, name, layout)


def mean_totals(ranks: list[dict[str, Any]]) -> StepStats:
    """The running totals averaged over the saved workers (kept when the residuals cannot be)."""
    totals = [StepStats.from_state_dict(rank.get("totals", {})) for rank in ranks]
    return StepStats.from_list([sum(values) / len(totals) for values in zip(*(t.as_list() for t in totals))])


def check_format(saved: dict[str, Any]) -> None:
    """Refuse, with the reason, an entry this version cannot read (all versions so far write format 1)."""
    version = saved.get("version")
    if version is None and "ranks" not in saved:
        raise ValueError(f"gradcomp: this is not a compression-state entry (its keys: {', '.join(map(str, saved))[:200]}); "
                         "load the entry that state_dict() returned, saved in your checkpoint, e.g. "
                         "handle.load_state_dict(checkpoint['gradcomp'])")
    if version != VERSION:
        raise ValueError(
            f"gradcomp: the checkpoint's compression state has format {version!r}; this version of "
            f"lightning-gradcomp reads format {VERSION} (written by 0.1.0 and later). Resume with the version that "
            "wrote it, or delete checkpoint['gradcomp'] to start the compression memory from zero."
        )
    missing = [key for key in ("world_size", "compressor", "ranks") if key not in saved]
    if missing or not isinstance(saved.get("ranks"), list) or not saved_states(saved):
        raise ValueError(f"gradcomp: the checkpoint's compression state is damaged (missing or empty: "
                         f"{', '.join(missing) or 'ranks'})")


def saved_states(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' states an entry holds: every worker's, or one rank's in its part."""
    return [state for state in saved["ranks"] if state is not None]


def describe_dropped(saved: dict[str, Any], workers: int, name: str, layout: str = "flat") -> str:
    """What a resume with another number of workers or another compressor drops, and what it keeps."""
    state_keys = sorted({key for rank in saved_states(saved) for states in rank.get("memory", {}).get("states", {}).values()
                         for key in states})
    steps = max(int(rank.get("step", 0)) for rank in saved_states(saved))
    dropped = "error-feedback residuals" + (f" and compressor state ({', '.join(state_keys)})" if state_keys else "")
    saved_layout = saved.get("layout", "flat")
    layouts = f" (exchange layout {saved_layout} vs {layout})" if saved_layout != layout else ""
    return (
        f"gradcomp: the checkpoint holds error-feedback memory of {saved['world_size']} workers of "
        f"{saved['compressor']}, this run has {workers} of {name}{layouts}; the residuals are dropped and start "
        "from zero. "
        f"Dropped: every worker's {dropped}. Kept: the step counter ({steps}, so random draws do not repeat), "
        "the running totals (averaged over the saved workers read: every one from a gathered entry, one from a "
        "rank's part) and the log of collectives."
    )


def _warn_on_first_rank(message: str) -> None:
    """A warning from rank 0 only (every rank restores the same entry)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
