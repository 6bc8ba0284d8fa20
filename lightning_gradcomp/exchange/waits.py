"""Bounded waits: the collectives the package adds outside the gradient exchange give up, and say why.

Registration compares the ranks' settings (:mod:`~lightning_gradcomp.exchange.agreement`), each local-update
synchronisation compares their schedule, ``summary()`` averages the figures: collectives of every rank of
the exchange that the user's script calls, not the training step. A rank that never gets there (a script
that registers or prints the summary under ``if rank == 0``, a rank still loading, a rank stuck elsewhere)
would leave the others waiting for the process group's timeout (30 minutes on gloo) and then fail with the
backend's "Operation timed out". Here each such collective is waited for at most
``GRADCOMP_WAIT_TIMEOUT`` seconds (600 by default), and the rank that gives up raises
:class:`WaitTimeout` naming the call, what it waited for, and the ranks that had not arrived.

Which ranks had not arrived: before the collective, each rank counts its arrival at the call in the
process group's store (one ``add`` per call, a round trip to the store's host); a rank that gives up reads
the others' counts, and those below its own never came. Without a store (torchft's groups) the message
names the call only.
"""

from __future__ import annotations

import math
import os
import zlib
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

WAIT_TIMEOUT_VARIABLE = "GRADCOMP_WAIT_TIMEOUT"
DEFAULT_WAIT_TIMEOUT_S = 600.0


class WaitTimeout(TimeoutError):
    """A collective the package adds outside the exchange (registration, a synchronisation's agreement, the
    summary) waited longer than ``GRADCOMP_WAIT_TIMEOUT`` seconds for the other ranks."""


def wait_timeout_s() -> float:
    """The bound in seconds: ``GRADCOMP_WAIT_TIMEOUT`` when set (a positive number), else 600."""
    text = os.environ.get(WAIT_TIMEOUT_VARIABLE)
    if text is None or text.strip() == "":
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{WAIT_TIMEOUT_VARIABLE} must be a positive number of seconds, got {text!r}")
    return seconds


class Arrival:
    """One rank's arrival at a collective of every rank of ``group`` that the package adds outside the
    exchange: made just before the collective is issued (it counts the arrival in the default store), then
    :meth:`wait` for the collective's work. ``call`` names the call the user made (``"register()"``),
    ``waiting_for`` what the collective carries, ``advice`` what the user does when a rank never comes."""

    def __init__(self, call: str, group: Optional[dist.ProcessGroup], waiting_for: str, advice: str = "") -> None:
        self.call, self.waiting_for, self.advice = call, waiting_for, advice
        self.ranks = dist.get_process_group_ranks(group) if group not in (None, dist.group.WORLD) else \
            list(range(dist.get_world_size()))
        self.rank = dist.get_rank()
        self.seconds = wait_timeout_s()
        self.store = _default_store()
        self.count: Optional[int] = None
        if self.store is not None:
            tag = zlib.crc32(f"{call}|{','.join(map(str, self.ranks))}".encode())
            self._prefix = f"gradcomp/arrivals/{tag:08x}/"
            self.count = self.store.add(self._prefix + str(self.rank), 1)

    def wait(self, work: Any) -> None:
        """Wait for ``work`` (the collective, issued with ``async_op=True``) at most ``GRADCOMP_WAIT_TIMEOUT``
        seconds; raise :class:`WaitTimeout` when it expires (any other failure is raised as it comes)."""
        try:
            work.wait(timedelta(seconds=self.seconds))
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            raise WaitTimeout(self.describe_timeout()) from error

    def missing(self) -> Optional[list[int]]:
        """The ranks (global) that arrived fewer times than this one, ``None`` when not counted."""
        if self.store is None or self.count is None:
            return None
        try:
            return [rank for rank in self.ranks if self.store.add(self._prefix + str(rank), 0) < self.count]
        except RuntimeError:  # the store's host is gone too
            return None

    def describe_timeout(self) -> str:
        """The message of :class:`WaitTimeout`."""
        missing = self.missing()
        if missing:
            absent = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reached it"
        elif missing is not None:
            absent = "every rank reached it as often, but some are waiting in another collective"
        else:
            absent = "some rank never reached it"
        return (f"gradcomp: {self.call} on rank {self.rank} waited {self.seconds:g} s for {self.waiting_for} from "
                f"ranks {', '.join(map(str, self.ranks))}, and {absent}. It is a collective: every rank of the "
                f"exchange calls it at the same point{'; ' + self.advice if self.advice else ''}. A rank that "
                f"is only slower (loading, compiling) needs a longer bound: {WAIT_TIMEOUT_VARIABLE}=<seconds> "
                f"(now {self.seconds:g})")


def _default_store() -> Any:
    """The default process group's store, or ``None`` where torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
