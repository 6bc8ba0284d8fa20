"""Time-boxed windows and weighted merging: a slow group no longer holds up the others.

After Decoupled DiLoCo (Douillard et al. 2026, "Decoupled DiLoCo", arXiv 2604.21428), whose learners run on
their own clocks and merge what each contributed, weighted by the tokens it processed. Lock-step local updates
(every group takes ``H`` inner steps, then all meet) run at the speed of the slowest group; with time-boxed
windows each group ``m`` takes the inner steps that fit in a window of ``W`` seconds at its own measured speed,
so that all groups reach each synchronisation at about the same time::

    W   = window_seconds,  or  H · min_m s_m      ("auto": from the last window's step times; the first is lock-step)
    k_m = F · round(W / (s_m · F)),  ≥ F·(τ+1)   group m's inner steps in the next window
    w_m = n_m / Σ_m n_m                          the weight of group m's outer gradient: Δ = Σ_m w_m·Δ_m

where ``s_m`` is group ``m``'s inner step time (the median of the window's intervals between two inner steps,
the synchronisations left out), ``n_m`` the samples (or tokens) it processed since the fragment's last
synchronisation, ``F`` the fragments and ``τ`` the ``delay``. Each rank multiplies its outer gradient by
``M·w_m`` before compression (the engine averages over the ``M`` groups), so error feedback keeps its meaning
(the residual is what was not sent of the weighted contribution); equal counts give ``M·w_m = 1`` exactly,
so a lock-step run is unchanged bit for bit.

The figures travel in the all-gather with which every synchronisation already checks the schedule
(:meth:`~lightning_gradcomp.local.loop.LocalUpdateLoop.agree_on_schedule`), the ranks of a group (an FSDP2
replica's shards, the processes of a fault-tolerant group) combined first, so that every rank computes the same
plan (:func:`plan_windows`, which also plans a run's last window). A group of one process also ends its window
at the window's deadline (:meth:`WindowClock.past_deadline`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

#: the figures of one row, after the fields that every rank must share (see :meth:`WindowClock.row`)
ROW_FIELDS = ("reporting", "final", "units", "step_ns", "left_after_window")

#: ``left_after_window`` of a rank that did not say how long its loop runs
UNBOUNDED = -1


@dataclass(frozen=True)
class GroupFigures:
    """What one group reported at a synchronisation (its ranks' figures combined)."""

    reporting: int  # 1: its units are samples/tokens reported with count(); 0: inner steps; -1: its ranks differ
    final: bool  # whether it called sync() to end its loop
    units: int  # samples (or tokens, or inner steps) since the fragment's last synchronisation
    step_seconds: float  # median inner step time this window (0: not measured)
    left_after_window: int  # inner steps its loop takes after this window ends (UNBOUNDED: not said)


class WindowClock:
    """One rank's figures of the window: the intervals between its inner steps, the samples it processed since
    each fragment's last synchronisation, and how many inner steps its loop takes in all."""

    def __init__(self, fragments: int) -> None:
        self.units_since = [0] * fragments
        #: samples (or tokens) reported with :meth:`count` and not yet assigned to an inner step
        self.reported = 0
        #: whether :meth:`count` was called (then the units are what it reported, else inner steps)
        self.reporting = False
        self.intervals: list[float] = []
        self._ready_at: Optional[float] = None
        #: the inner steps this rank's loop takes in all (``None``: not said)
        self.total_steps: Optional[int] = None

    def count(self, units: int) -> None:
        """``units`` samples (or tokens) processed by the coming inner step."""
        self.reported += units
        self.reporting = True

    def run_for(self, steps: int) -> None:
        self.total_steps = steps

    def stepped(self) -> None:
        """An inner step ended: record its interval (since the last step's end, after its synchronisations)
        and its units."""
        now = time.perf_counter()
        if self._ready_at is not None:
            self.intervals.append(now - self._ready_at)
        units = self.reported if self.reporting else 1
        self.reported = 0
        for fragment in range(len(self.units_since)):
            self.units_since[fragment] += units

    def ready(self, window_seconds: float = 0.0) -> None:
        """The synchronisations of a step are done: the next interval starts now; with ``window_seconds``, a
        window ended with them, and the next one's deadline is that long from now."""
        self._ready_at = time.perf_counter()
        if window_seconds > 0:
            self.deadline = self._ready_at + window_seconds

    #: when the current time-boxed window should end (``None``: not set, the window's planned steps decide)
    deadline: Optional[float] = None

    def past_deadline(self) -> bool:
        """Whether the next inner step would end after the window's deadline by more than half a step (the
        step just taken counted): a group that started its window late (it healed from the others, or
        stalled) ends it on time instead of arriving late again."""
        if self.deadline is None or not self.intervals:
            return False
        return time.perf_counter() + 0.5 * self.step_seconds() >= self.deadline

    def step_seconds(self) -> float:
        """The median interval between inner steps since the last window's plan (0 when none was measured);
        the median ignores a one-off stall."""
        return statistics.median(self.intervals) if self.intervals else 0.0

    def started(self, fragment: int) -> None:
        """Fragment ``fragment``'s synchronisation started: its count starts again."""
        self.units_since[fragment] = 0

    def planned(self) -> None:
        """A window was planned from the intervals: the next one measures afresh."""
        self.intervals = []

    def state_dict(self) -> dict[str, object]:
        """What a resume needs for the same weights: the samples since each fragment's last synchronisation and
        whether they are reported (the step times are measured afresh)."""
        return {"units_since": list(self.units_since), "reporting": self.reporting}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:  # a checkpoint from before weighted merging: counted from the resume
            return
        if len(state["units_since"]) == len(self.units_since):
            self.units_since = [int(units) for units in state["units_since"]]
        self.reporting = bool(state["reporting"])

    def row(self, fragment: int, final: bool, left_after_window: int) -> list[int]:
        """This rank's figures (:data:`ROW_FIELDS`) as integers, for the all-gather."""
        units = self.units_since[fragment] if 0 <= fragment < len(self.units_since) else 0  # a bad one is refused
        return [int(self.reporting), int(final), units, round(self.step_seconds() * 1e9), left_after_window]


def group_figures(row: Sequence[int]) -> GroupFigures:
    """A row of :data:`ROW_FIELDS` (a group's, see :func:`combine_within_group`) as :class:`GroupFigures`."""
    reporting, final, units, step_ns, left = row
    return GroupFigures(int(reporting), bool(final), int(units), step_ns / 1e9, int(left))


def merge_weights(units: Sequence[int]) -> list[float]:
    """``M·w_m = M·n_m / Σ n``, the factor each group's outer gradient is multiplied by before the engine
    averages over ``M``; exactly 1 for equal counts (and equal weights when nothing was counted)."""
    total = sum(units)
    if total <= 0:
        return [1.0] * len(units)
    return [len(units) * count / total for count in units]


def window_seconds_for(step_seconds: Sequence[float], sync_every: int) -> float:
    """``W`` of ``window_seconds="auto"``: ``H`` times the fastest group's step time (0 if none measured)."""
    measured = [seconds for seconds in step_seconds if seconds > 0]
    return sync_every * min(measured) if measured else 0.0


def steps_in_window(window: float, step_seconds: float, sync_every: int, fragments: int, delay: int) -> int:
    """``k = F·round(W / (s·F))``, at least ``F·(τ+1)`` (each fragment's exchange overlaps ``τ`` steps of its
    share); ``H`` where ``s`` or ``W`` is unknown."""
    least = fragments * (delay + 1)
    if step_seconds <= 0 or window <= 0:
        return max(sync_every, least)
    return max(least, fragments * round(window / (step_seconds * fragments)))


@dataclass(frozen=True)
class WindowPlan:
    """The next window of every group, the same on every rank."""

    lengths: list[int]  # each group's inner steps in the next window
    window_seconds: float  # ``W``
    last: bool  # whether the next window ends the run
    ends_now: bool  # whether the run ends with this window (a group cannot fit another one)


def plan_windows(groups: Sequence[GroupFigures], window_seconds: float, sync_every: int, fragments: int,
                 delay: int) -> WindowPlan:
    """The next window's length of each group from its step time (see the module's equations). When a group
    whose loop has a known length has less than one and a half windows left, the next window is the last one,
    stretched or shrunk so that this group ends exactly at its last step (rounded down to a multiple of ``F``)
    and the others in proportion."""
    if window_seconds <= 0:
        window_seconds = window_seconds_for([group.step_seconds for group in groups], sync_every)
    lengths = [steps_in_window(window_seconds, group.step_seconds, sync_every, fragments, delay) for group in groups]
    least = fragments * (delay + 1)
    bounded = [(group.left_after_window, length) for group, length in zip(groups, lengths)
               if group.left_after_window != UNBOUNDED]
    if any(left < least for left, _ in bounded):
        return WindowPlan(lengths, window_seconds, last=False, ends_now=True)
    if any(left < max(length + least, 1.5 * length) for left, length in bounded):  # a remainder under half a window
        # joins this one
        factor = min(fragments * (left // fragments) / length for left, length in bounded)
        lengths = [max(least, fragments * math.floor(length * factor / fragments + 0.5)) for length in lengths]
        return WindowPlan(lengths, window_seconds, last=True, ends_now=False)
    return WindowPlan(lengths, window_seconds, last=False, ends_now=False)


def check_figures(groups: Sequence[GroupFigures], weight_by: Optional[str], time_boxed: bool) -> Optional[str]:
    """What is wrong with the groups' figures, the same text on every rank (``None``: nothing): groups that
    count differently (some report samples with ``count()``, others count inner steps), ``weight_by="tokens"``
    without counts, a group that ended its loop (``sync()``) while the others go on under time-boxed windows,
    or a time-boxed run whose loops never said their length."""
    reporting = {group.reporting for group in groups}
    if weight_by is not None and (len(reporting) > 1 or -1 in reporting):
        which = [index for index, group in enumerate(groups) if group.reporting]
        return (f"the groups count their {weight_by} differently: group(s) {which} report them with count(), the "
                "others count inner steps; call handle.count(n) on every rank before each inner step, or on none")
    if weight_by == "tokens" and reporting == {0}:
        return ("weight_by='tokens' weights each group by the tokens it reports; call handle.count(tokens) on every "
                "rank before each inner step (or use weight_by='samples', which counts inner steps by default)")
    if time_boxed:
        finals = [group.final for group in groups]
        if any(finals) and not all(finals):
            which = [index for index, final in enumerate(finals) if final]
            return (f"group(s) {which} called sync() to end training while the others are inside their time-boxed "
                    "window; under window_seconds the run ends where every group planned it: say each loop's "
                    "length with handle.run_for(steps) and stop the loop when handle.finished is True (the Trainer "
                    "does both)")
        if not any(finals) and all(group.left_after_window == UNBOUNDED for group in groups):
            return ("under window_seconds the groups take different numbers of inner steps, so no loop can end at "
                    "a fixed step of its own: say each loop's length with handle.run_for(steps) (the inner steps "
                    "it would take in all) and stop the loop when handle.finished is True; the run ends when the "
                    "first group's steps run out, every group at the same synchronisation (the Trainer says it "
                    "from max_steps or max_epochs: set one)")
    return None


def combine_within_group(summed: Sequence[int], ranks: int) -> list[int]:
    """A group's row from its ``ranks`` ranks' figures ``summed`` (one all-reduce): the units summed, the step
    times averaged, the loop's length and the flags as one rank's (``reporting`` mixed within the group is
    reported as reporting by some groups only, which :func:`check_figures` refuses)."""
    reporting, final, units, step_ns, left = summed
    return [int(reporting == ranks) if reporting in (0, ranks) else -1, int(final > 0), units,
            step_ns // ranks, left // ranks]
