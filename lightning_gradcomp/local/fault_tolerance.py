"""Fault-tolerant local updates: torchft as the membership layer under the outer loop.

Each replica group is an ordinary job of its own (one process, or several: DDP or FSDP2 inside the group,
each rank exchanging with the same rank of the other groups); torchft's lighthouse, started by the
user, forms a *quorum* of the groups present at every synchronisation, and torchft's reconfigurable process
group joins them. One synchronisation (DiLoCo's outer step, Douillard et al. 2023, Algorithm 1)::

    quorum      = lighthouse(groups alive)            # a group that died is dropped after the heartbeat timeout;
                                                      # one that (re)joins heals: θ_global, the outer optimizer's
                                                      # state and the schedule position from a live peer
    Δ̄           = (1/|P|) Σ_{w∈P} C_w(Δ_w)            # the exchange engine over torchft's group, P the participants
    commit      = this group's exchange succeeded      # torchft's should_commit (every rank of the group votes)
    θ_global   ← OuterOpt(θ_global, Δ̄)  if commit     # else rolled back: the group restarts from the unchanged
                                                      # θ_global, its residuals from zero; the next window retries

A failed exchange usually fails for every participant, and all roll back. A group that rolled back while
others committed is one step behind them in torchft's count, and heals from them (θ_global, the outer state)
at the next quorum.

A group of several processes holds the model whole (DDP inside the group; the loop's layout
:class:`RowBlocksOfModel`: each rank exchanges a row block of every parameter's Δ) or sharded
(:class:`~lightning_gradcomp.local.sharded.ShardsOfModel`). A live group later than the lighthouse's
``--join_timeout_ms`` (the grace period, see :class:`FaultTolerance`; with time-boxed windows a fraction of the
window) is left out of the synchronisation and heals at the next one. Torchft's own ``DiLoCo`` ends bit for bit
where ours does without faults (``tests/test_torchft_diloco.py``).

torchft is an optional dependency (``pip install "lightning-gradcomp[ft]"``): imported here only when a
:class:`FaultTolerance` is used.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import urllib.parse
import time
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.drivers import CollectiveError, ReconfigurableDriver, world_collective_device
from lightning_gradcomp.local.config import LocalUpdates
from lightning_gradcomp.local.loop import FixedMembership, LocalUpdateLoop, PendingSync, WholeModel
from lightning_gradcomp.local.outer import trainable_parameters

#: the command the refusal without torchft names
INSTALL = 'pip install "lightning-gradcomp[ft]"  (or: pip install torchft)'


@dataclass(frozen=True)
class FaultTolerance:
    """Run the outer synchronisations of local updates through torchft, so that the job survives a lost
    replica group.

    Args:
        lighthouse: the lighthouse's address, ``"http://host:port"`` (default: the ``TORCHFT_LIGHTHOUSE``
            environment variable, as torchft's own scripts read it). Start it first:
            ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``. Its
            ``--join_timeout_ms`` is the grace period of a synchronisation: a live group later than that is
            left out of it, and heals from the others (its late window dropped) at the next one.
        replica_id: this replica group's name, unique among the groups (default: ``REPLICA_GROUP_ID`` from
            the environment, else the host name and process id). A replacement may reuse a dead group's name.
        timeout: seconds a collective, a checkpoint transfer or a commit may take.
        quorum_timeout: seconds a synchronisation waits for the quorum to form.
        connect_timeout: seconds to reach the lighthouse and the peers' managers.
        expected_groups: at a fresh start (every group at step 0), wait until this many replica groups are in
            the quorum before the first window, at most ``start_timeout`` seconds, so that groups launched
            together train together. ``None`` (default): the first quorum the lighthouse forms (with its
            ``--min_replicas 1``, often the first group alone, which then trains a window before the others
            heal from it). A group that joins a running job does not wait.
        start_timeout: the most seconds the fresh start waits for ``expected_groups``; then training starts
            with the groups there, with a warning, and the others join as they come.
    """

    lighthouse: Optional[str] = None
    replica_id: Optional[str] = None
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    expected_groups: Optional[int] = None
    start_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.expected_groups is not None and (isinstance(self.expected_groups, bool) or
                                                 not isinstance(self.expected_groups, int) or self.expected_groups < 1):
            raise ValueError(f"`FaultTolerance.expected_groups` must be None (no wait at the start) or the number of "
                             f"replica groups to wait for at a fresh start, an int >= 1, got {self.expected_groups!r}")
        for name in ("timeout", "quorum_timeout", "connect_timeout", "start_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"`FaultTolerance.{name}` must be a finite number of seconds > 0, got {value!r}")
        if self.replica_id is not None and (not isinstance(self.replica_id, str) or not self.replica_id):
            raise ValueError(f"`FaultTolerance.replica_id` must be None (REPLICA_GROUP_ID, else host and process) or "
                             f"a non-empty str naming this replica group, got {self.replica_id!r}")
        address = self.address
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"`FaultTolerance.lighthouse` must be the lighthouse's address 'http://host:port' "
                             f"(or set TORCHFT_LIGHTHOUSE), got {address!r}")

    @property
    def address(self) -> str:
        """The lighthouse's address: :attr:`lighthouse`, else ``TORCHFT_LIGHTHOUSE``."""
        address = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not address:
            raise ValueError("FaultTolerance: no lighthouse address; pass FaultTolerance(lighthouse='http://host:port') "
                             "or set TORCHFT_LIGHTHOUSE, after starting `torchft_lighthouse --min_replicas 1`")
        return address

    @property
    def group_name(self) -> str:
        return self.replica_id or os.environ.get("REPLICA_GROUP_ID") or f"{os.uname().nodename}-{os.getpid()}"

    def for_group(self) -> "FaultTolerance":
        """This configuration with one name for every process of the group (each calls it at the same
        point): the default name (host name and process id) differs between a group's processes, so rank 0's
        is broadcast over the group's ``torch.distributed`` world; a given name is kept."""
        if (self.replica_id or os.environ.get("REPLICA_GROUP_ID") or not dist.is_available()
                or not dist.is_initialized() or dist.get_world_size() == 1):
            return self
        names = [self.group_name]
        dist.broadcast_object_list(names, src=0)
        return dataclasses.replace(self, replica_id=names[0])

    def data_seed(self, seed: int) -> int:
        """The seed of this group's data order: ``seed`` mixed with the group's name, so that groups running
        the same script (the same ``seed_everything``) shuffle their data differently instead of all taking
        the same batches (the number of groups changes as they leave and join, so the data are not split
        between them: each group draws its own order of the whole set, as torchft's examples do). The
        Trainer's and Fabric's distributed samplers use it (after :meth:`for_group`, the same on every rank
        of the group)."""
        return (seed + zlib.crc32(self.group_name.encode())) % 2**31


def torchft_module() -> Any:
    """``torchft``, or a ``ValueError`` with the install command."""
    try:
        import torchft
    except ImportError as error:
        raise ValueError(f"gradcomp: fault_tolerance needs torchft, which is not installed: {INSTALL}") from error
    return torchft


def describe_no_quorum(config: FaultTolerance, error: BaseException) -> str:
    """Why no quorum formed: the lighthouse is unreachable, or it answers and too few replica groups joined
    (it waits for its ``--min_replicas``)."""
    shown = " ".join(str(error).split())[:300]
    if lighthouse_answers(config.address):
        return (f"gradcomp: no quorum from the torchft lighthouse at {config.address} within quorum_timeout="
                f"{config.quorum_timeout:g} s, though the lighthouse answers: fewer replica groups joined than it "
                "waits for (its --min_replicas, and --join_timeout_ms for late groups). Start the other replica groups "
                "(each with its own REPLICA_GROUP_ID / FaultTolerance(replica_id=...)), start the lighthouse with a "
                f"lower --min_replicas, or raise FaultTolerance(quorum_timeout=...). ({shown})")
    return (f"gradcomp: no quorum from the torchft lighthouse at {config.address} within {config.quorum_timeout:g} s: "
            "nothing answers at that address. Start `torchft_lighthouse --min_replicas 1` there (or pass its address: "
            f"FaultTolerance(lighthouse='http://host:port') or TORCHFT_LIGHTHOUSE). ({shown})")


def lighthouse_answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the lighthouse's ``http://host:port``."""
    try:
        parsed = urllib.parse.urlsplit(address)
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 80), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


@dataclass
class MembershipFigures:
    """What fault tolerance did, for telemetry and the summary."""

    #: participants of each quorum this group took part in (its join, then every synchronisation)
    participants: list[int] = field(default_factory=list)
    commits: int = 0
    rollbacks: int = 0
    #: seconds spent waiting for quorums (a lost group's heartbeat timeout shows here)
    quorum_seconds: float = 0.0
    #: synchronisations at which this group healed from a peer
    heals: int = 0
    #: quorums with fewer participants than the one before (groups left)
    departures: int = 0

    def describe(self) -> str:
        counts = self.participants or [0]
        return (f"fault tolerance: {self.commits + self.rollbacks} synchronisations, {self.commits} committed, "
                f"{self.rollbacks} rolled back; replica groups per quorum {min(counts)}-{max(counts)} (last "
                f"{counts[-1]}), fewer than before {self.departures} time(s); this group healed {self.heals} time(s); "
                f"{self.quorum_seconds:.1f} s waiting for quorums")


def _store_address() -> tuple[str, int]:
    """The replica group's own store (torch.distributed's, as torchrun's ``MASTER_ADDR``/``MASTER_PORT``)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise ValueError("gradcomp: fault_tolerance uses the replica group's torch.distributed store: set MASTER_ADDR and "
                         "MASTER_PORT (torchrun does) and init_process_group(...) before local_updates()")
    return address, int(port)


@dataclass(frozen=True)
class RowBlock:
    """One rank's rows of a tensor: elements ``[start, stop)`` of its flat view, exchanged as a tensor of
    ``shape`` (``(rows, *shape[1:])``)."""

    start: int
    stop: int
    shape: tuple[int, ...]


def row_blocks(shape: tuple[int, ...], ranks: int) -> list[RowBlock]:
    """Each rank's block of a tensor's rows (dim 0, ``torch.chunk``'s split, as FSDP2 shards): the same on
    every rank and in every replica group, so that rank r of each group exchanges the same elements; a
    0-d tensor is one row; a rank past the last row gets an empty block."""
    rows = shape[0] if shape else 1
    width = math.prod(shape[1:]) if shape else 1
    per_rank = -(-rows // ranks)
    blocks = []
    for rank in range(ranks):
        first, last = min(rows, rank * per_rank), min(rows, (rank + 1) * per_rank)
        blocks.append(RowBlock(first * width, last * width, (last - first, *shape[1:]) if shape else (last - first,)))
    return blocks


class RowBlocksOfModel(WholeModel):
    """The layout of a whole model on each process of a replica group (kept equal by DistributedDataParallel
    inside the group): the group's ranks split the exchange, each sending a row block of every parameter
    (:func:`row_blocks`) to the same rank of the other groups, then broadcasting the averages of its blocks
    inside the group, so that every rank steps θ_global alike; the group's buffers are its first rank's
    before they are averaged between groups (DDP does not sync them in forward under local updates)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.blocks = [row_blocks(tuple(p.shape), dist.get_world_size()) for p in params]

    def ranks_per_replica(self) -> int:
        return dist.get_world_size()

    def sum_within_replica(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def exchanged(self, index: int, tensor: torch.Tensor) -> Optional[tuple[slice, tuple[int, ...]]]:
        block = self.blocks[index][dist.get_rank()]
        return (slice(block.start, block.stop), block.shape) if block.stop > block.start else None

    def share(self, indices: Sequence[int], averaged: Sequence[torch.Tensor]) -> None:
        device = world_collective_device()
        for rank in range(dist.get_world_size()):
            parts = [flat[block.start:block.stop] for index, flat in zip(indices, averaged)
                     for block in [self.blocks[index][rank]] if block.stop > block.start]
            if not parts:
                continue
            joined = torch.cat(parts).to(device)
            dist.broadcast(joined, rank)
            torch._foreach_copy_(parts, [piece.to(parts[0].device) for piece in joined.split([p.numel() for p in parts])])

    def equalise_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer in buffers:
            dist.broadcast(buffer, 0)


class TorchftMembership(FixedMembership):
    """The membership of a replica group under torchft, composed into the loop
    (:class:`~lightning_gradcomp.local.loop.LocalUpdateLoop`'s ``membership``; see the module's text): torchft's
    ``Manager`` for this process of the group (the group is this job's ``torch.distributed`` world), the
    exchange over the quorum's process group (:class:`ReconfigurableDriver`), the vote of every rank of the group,
    and the state a joining group receives (each rank its own, from the same rank of a live group).

    When the loop is built the group joins: with every group at step 0 (a fresh start) the quorum only agrees
    on the initial weights (torchft copies the first group's to the others); a group that joins a running job
    (a replacement) receives θ_global, the outer optimizer's state and the schedule position from a live peer
    and takes part in that synchronisation at once, with a zero outer gradient.

    With fragments (Streaming DiLoCo) each fragment's synchronisation is one quorum, exchange and vote, and a
    rollback restores that fragment alone; with ``delay`` the exchange runs on the exchange thread (over
    torchft's group) while the inner steps go on, and the vote comes at the merge (``delay`` is below
    ``H / fragments``, so one fragment's synchronisation ends before the next one's quorum).
    """

    def __init__(self, config: FaultTolerance) -> None:
        self.config = config
        self.figures = MembershipFigures()
        self._last_participants = 0
        self._participants = 1
        self._failed: Optional[BaseException] = None
        self._quorum_taken = False
        #: the synchronisation whose quorum this group takes (fragment, merge_at): a group that heals there
        #: receives it and takes part in the same one
        self._syncing: Optional[tuple[int, int]] = None
        #: whether this group healed from a running job when it joined (a checkpoint's outer state is then stale)
        self.joined_running_job = False

    def attach(self, loop: LocalUpdateLoop) -> None:
        if type(loop.layout) is WholeModel and dist.get_world_size() > 1:
            raise ValueError("gradcomp: a replica group of several processes that each hold the whole model needs the "
                             "RowBlocksOfModel layout (fault_tolerant_loop() picks it): build the loop with it")
        super().attach(loop)
        self.driver = ReconfigurableDriver()
        loop.exchange.use_driver(self.driver)
        torchft = torchft_module()
        config = self.config
        self.group = torchft.ProcessGroupGloo(timeout=timedelta(seconds=config.timeout))
        store = _store_address()
        try:
            self.manager = torchft.Manager(
                pg=self.group, min_replica_size=1, use_async_quorum=False, load_state_dict=self._receive_state,
                state_dict=self._shared_state, replica_id=config.group_name, store_addr=store[0], store_port=store[1],
                rank=dist.get_rank(), world_size=dist.get_world_size(), lighthouse_addr=config.address,
                timeout=timedelta(seconds=config.timeout), quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timedelta(seconds=config.connect_timeout))
        except Exception as error:  # the lighthouse (or this group's manager on rank 0) cannot be reached
            raise RuntimeError(f"gradcomp: could not reach the torchft lighthouse at {config.address} (FaultTolerance("
                               f"lighthouse=...) or TORCHFT_LIGHTHOUSE) within connect_timeout={config.connect_timeout:g} "
                               f"s: {error}; is `torchft_lighthouse` running there, and reachable from this host?") from error
        self._join()
        #: the schedule position when this group joined (0 at a fresh start)
        self.joined_at_step = loop.outer.optimizer_steps

    # ------------------------------------------------------------------ torchft's manager
    def quorum(self) -> tuple[Any, int]:
        """Join the quorum of this synchronisation (heals this group first if it is behind); the process group
        between the groups and the number of participants."""
        began = time.perf_counter()
        step_before = self.manager.current_step()
        try:
            self.manager.start_quorum()
        except Exception as error:  # the lighthouse unreachable, or no quorum in time
            raise RuntimeError(describe_no_quorum(self.config, error)) from error
        self.figures.quorum_seconds += time.perf_counter() - began
        if self.manager.current_step() != step_before:
            self.figures.heals += 1
        participants = self.manager.num_participants()
        if self._last_participants and participants < self._last_participants:
            self.figures.departures += 1
        self._last_participants = participants
        self.figures.participants.append(participants)
        return getattr(self.group, "_pg", None), participants

    def _vote(self) -> bool:
        """torchft's commit vote (every rank of this group; one that failed says no)."""
        committed = self.manager.should_commit()
        if committed:
            self.figures.commits += 1
        else:
            self.figures.rollbacks += 1
        return committed

    def _fail(self, error: BaseException) -> None:
        """This group's exchange failed: it votes no at the merge."""
        if self._failed is None:
            self._failed = error
            self.manager.report_error(error)

    def shutdown(self) -> None:
        """Leave the quorum (the manager's server stops; the others go on without this group)."""
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ joining
    def _join(self) -> None:
        loop = self.loop
        self._take_quorum()  # a group behind the others heals here (_receive_state)
        if self.manager.current_step() == 0:  # a fresh start: every group holds the first's weights
            self._wait_for_the_expected_groups()
            if self._failed is None:
                try:  # a barrier: no group commits (its checkpoint server moves on) before every group has healed
                    self.driver.all_reduce(torch.zeros(1))
                except CollectiveError as error:
                    self.manager.report_error(error)
            self.manager.should_commit()
            self._quorum_taken = False
            if isinstance(loop.layout, RowBlocksOfModel):
                self._equalise_group()
            return
        # a running job's synchronisation, the one the others are starting (received with the state): take
        # part, with a zero outer gradient, and merge it when they do (at once, or after `delay` steps)
        self.joined_running_job = True
        loop._run(*(self._received_syncing or (0, loop.outer.delay)))

    #: seconds between two quorums while a fresh start waits for the expected groups
    START_POLL_S = 0.05

    def _wait_for_the_expected_groups(self) -> None:
        """At a fresh start, with ``FaultTolerance(expected_groups=N)``: take quorums again (none committed: the
        step stays 0) until N groups are in one, for about ``start_timeout`` seconds at most (its polls of
        ``START_POLL_S``, plus the quorums' own time). Every group that is waiting
        does the same, so the quorum that holds N holds each of them, and they all go on from it together."""
        config = self.config
        if config.expected_groups is None:
            return
        departures = self.figures.departures
        # counted in polls, not read from each process's clock: the processes of a group take the same quorums
        # and must stop after the same one (a process that stopped alone would leave the others' next quorum
        # waiting for it)
        for _ in range(math.ceil(config.start_timeout / self.START_POLL_S)):
            if self._participants >= config.expected_groups:
                break
            time.sleep(self.START_POLL_S)
            self._take_quorum()
        if self._participants < config.expected_groups:
            warnings.warn(f"gradcomp: fault tolerance: {self._participants} of the {config.expected_groups} expected "
                          f"replica groups after start_timeout={config.start_timeout:g} s; training starts with them, "
                          "and the others join when they come (healing from θ_global)", UserWarning, stacklevel=2)
        del self.figures.participants[:-1]  # the quorums of the wait are not synchronisations
        self.figures.departures = departures

    def _take_quorum(self) -> None:
        # the last synchronisation's figures are closed among the groups that made them: bytes depend on the
        # group's size, which the quorum may change
        self.loop.exchange.flush()
        group, self._participants = self.quorum()
        self._failed = None if group is not None else (self.manager.errored() or
                                                       RuntimeError("the quorum's process group was not configured"))
        if group is not None:
            self.driver.use(group)
        self._quorum_taken = True

    @torch.no_grad()
    def _equalise_group(self) -> None:
        """At a fresh start torchft gives each rank the weights of the same rank of *some* group, chosen per
        rank: a group of DDP processes could start from several groups' initial weights. Its first rank's
        (now the same in every group) are broadcast inside the group and become θ_global."""
        loop = self.loop
        for tensor in [*loop.params, *(buffer for _, buffer in loop.buffers)]:
            dist.broadcast(tensor.data, 0)
        for glob, param in zip(loop.outer.global_params, loop.params):
            glob.copy_(param.detach())
        for fragment in range(loop.outer.fragments):
            loop.global_buffers.record(fragment, [buffer for _, buffer in loop.buffers])

    # ------------------------------------------------------------------ what a joining group receives
    def _shared_state(self) -> dict[str, Any]:
        """θ_global, the outer optimizer's state and the schedule position (torchft's checkpoint transport
        sends it to a group that heals)."""
        outer = self.loop.outer
        syncing = None
        if self._syncing is not None:  # which synchronisation this quorum is for, and when it merges
            fragment, merge_at = self._syncing
            syncing = (fragment, merge_at - outer.optimizer_steps)
        return {"outer": outer.state_dict(), "global_buffers": self.loop.global_buffers.state_dict(),
                "syncing": syncing}

    #: the synchronisation the peer that sent the state was starting (fragment, steps until its merge)
    _received_syncing: Optional[tuple[int, int]] = None

    @torch.no_grad()
    def _receive_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`_shared_state`: this group continues from θ_global, with fresh residuals and
        compressor state."""
        loop = self.loop
        loop._adopt_saved_fragments(state["outer"])  # a group that joins before its first step: the peers' grouping
        loop.outer.load_state_dict(state["outer"])
        loop.global_buffers.load_state_dict(state.get("global_buffers"))
        loop.adopt_global()
        loop.exchange.memory.clear()
        loop.clock.units_since = [0] * loop.outer.fragments  # its work since is dropped: it merges with weight 0
        self._received_syncing = tuple(state["syncing"]) if state.get("syncing") is not None else None

    # ------------------------------------------------------------------ a synchronisation (the loop's hooks)
    def begin(self, fragment: int, merge_at: int) -> bool:
        """Take this synchronisation's quorum (unless joining took it); exchange when it formed."""
        self._syncing = (fragment, merge_at)
        if not self._quorum_taken:
            self._take_quorum()
        self._quorum_taken = False
        self._syncing = None
        return self._failed is None

    def exchange_failed(self, error: CollectiveError) -> bool:
        """A group died during the exchange: this group votes no (the others, too, usually); absorbed."""
        self._fail(error)
        return True

    def agree(self, fragment: int, merge_at: int) -> None:
        """Check that every participant exchanges the same thing now (one small all-gather): the fragment, the
        elements this rank exchanges, its group's number of processes (and the window under
        ``window_seconds``), then its group's figures (:mod:`~lightning_gradcomp.local.windows`: the samples
        behind its outer gradient, its step time, its loop's length). Groups of different sizes, or a group
        joined at another synchronisation, would otherwise exchange tensors of different sizes (gloo aborts the
        process) or mix fragments; a disagreement raises :class:`CollectiveError`: a rollback.

        A group that healed into this synchronisation (no inner step since: its outer gradient is zero) does
        not make the others' weights unequal: when every group that trained counted alike, the weights stay 1
        and the participants' average is taken as before weighting existed (the quorum's size over the
        participants', :meth:`commit`), bit for bit."""
        loop = self.loop
        elements = sum(loop._exchanged_elements(i) for i in loop.outer.members(fragment))
        window = loop.outer.windows if loop.outer.time_boxed else 0
        shared = [fragment, elements, dist.get_world_size(), window]
        rows, groups = loop._gather_rows(shared, fragment, world_collective_device())  # over torchft's group
        if any(row != tuple(shared) for row in rows):
            raise CollectiveError(
                "the replica groups disagree on this synchronisation (rows: fragment, elements exchanged by this "
                f"rank, processes per group, window): {[list(row) for row in rows]}; every group needs the "
                "same number of processes, model, sync_every and fragments")
        loop._take_weight(fragment, groups, self.driver.rank)
        if len({group.units for group in groups if group.units > 0}) <= 1:
            loop.weight, loop.weights_equal = 1.0, True

    def settle(self, pending: PendingSync) -> None:
        """Wait for an overlapped exchange (``delay > 0``); its failure is this group's vote (no), and what
        arrived is replaced by zeros (shared inside the group alike, applied nowhere)."""
        for future in pending.futures:
            try:
                future.wait()
            except CollectiveError as error:
                self._fail(error)
        pending.futures = []
        if self._failed is not None:
            for averaged in pending.averaged:
                averaged.zero_()

    def commit(self, pending: PendingSync) -> bool:
        """Vote (after the loop shared the group's averages inside it); on a commit, scale the average to the
        participants'."""
        loop = self.loop
        committed = self._vote()
        if committed and self._failed is None:
            # the engine averaged over the quorum's size; a group that healed into this synchronisation sent a
            # zero outer gradient: scaled back to the participants' average, unless the weights (by samples, see
            # local/windows.py: a healed group's are 0) did that already
            scale = self.driver.world_size / self._participants if loop.weights_equal else 1.0
            if scale != 1.0:
                torch._foreach_mul_(pending.averaged, scale)
            return True
        reason = self._failed or "another replica group failed"
        warnings.warn(f"gradcomp: synchronisation {loop.outer.syncs + 1} (fragment {pending.fragment}) was rolled back "
                      f"({reason}); this replica group restarts this fragment from its unchanged global parameters "
                      "and the inner steps since its last synchronisation are dropped", RuntimeWarning, stacklevel=4)
        return False

    def accepts_checkpoint(self) -> bool:
        """A checkpoint of this group is loaded, unless the group joined a running job: then the state it healed
        from the others (θ_global, the outer state, the schedule position) is newer, and the checkpoint's
        local-update state is dropped with a warning."""
        if self.joined_running_job:
            warnings.warn("gradcomp: this replica group joined a running job and received θ_global and the schedule "
                          "position from a live group; the checkpoint's local-update state (older) is not loaded",
                          UserWarning, stacklevel=3)
        return not self.joined_running_job


def fault_tolerant_loop(module: torch.nn.Module, config: LocalUpdates, exchange: ExchangeSession,
                        fault_tolerance: FaultTolerance, global_device: Optional[torch.device] = None,
                        layout: Optional[WholeModel] = None) -> LocalUpdateLoop:
    """The outer loop of one process of a replica group under torchft: the loop with :class:`TorchftMembership`.

    Args:
        module, config, exchange, global_device: as for the loop (``exchange``'s driver is replaced by one over
            torchft's group); with a whole model on several processes, ``module`` is the one DDP wraps.
        fault_tolerance: the lighthouse and this group's name.
        layout: FSDP2 shards (:class:`~lightning_gradcomp.local.sharded.ShardsOfModel`), or ``None``: whole, on one
            process (:class:`~lightning_gradcomp.local.loop.WholeModel`) or on each of several (:class:`RowBlocksOfModel`).
    """
    if layout is None and dist.get_world_size() > 1:  # a whole model on each of the group's processes
        layout = RowBlocksOfModel([p for _, p in trainable_parameters(module)])
    return LocalUpdateLoop(module, config, exchange, global_device=global_device, layout=layout,
                           membership=TorchftMembership(fault_tolerance))
