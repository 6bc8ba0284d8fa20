"""The global side of local-update training: ``θ_global``, the outer optimizer, the window of inner steps.

The outer step (Douillard et al. 2023, Algorithm 1; Reddi et al. 2021, "Adaptive Federated
Optimization", for the outer optimizer as a server optimizer)::

    Δ_w      = θ_global − θ_w                 each worker's outer gradient after H inner steps
    Δ̄        = (1/N) Σ_w C_w(Δ_w)             the exchange engine's average of the compressed Δ_w
    θ_global ← OuterOpt.step(θ_global, Δ̄)    e.g. Nesterov SGD: b ← μb + Δ̄;  θ ← θ − lr(Δ̄ + μb)
    θ_w      ← θ_global

``θ_global`` is kept in fp32 (fp64 for fp64 parameters) whatever the parameters' dtype, so that a bf16
model's small outer steps do not round away, with the outer optimizer's state on the parameters' device or in
host memory (``device="cpu"``, as torchft's ``backup_device``); ``Δ`` is formed in that dtype, on the
parameters' device. A ``Δ̄`` that is not finite is never applied (:meth:`OuterModel.apply`): every worker
restarts from the unchanged ``θ_global``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_gradcomp.core.device import state_dtype
from lightning_gradcomp.local.config import LocalUpdates
from lightning_gradcomp.local.fragments import assign_fragments, checked_assignment


class OuterModel:
    """``θ_global``, the outer optimizer over it, the fragments and their schedule.

    Args:
        names: the trainable parameters' names (the same on every worker).
        params: the parameters, whose values at construction become ``θ_global``.
        config: ``sync_every``, the outer optimizer, the fragments, ``delay``, ``overlap`` and ``alpha``.
        fragment_of: the fragment of each parameter, from :func:`fragment_assignment` (which sees the
            module); ``None``: from the names alone (:func:`assign_fragments`: modules dealt out in turn, or
            the user's fragments given by name).
        device: where ``θ_global`` and the outer optimizer's state live (default: each parameter's device;
            ``"cpu"``: host memory, pinned when the parameters are on an accelerator).
    """

    def __init__(self, names: Sequence[str], params: Sequence[Tensor], config: LocalUpdates,
                 fragment_of: Optional[Sequence[int]] = None,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        self.names = list(names)
        self.device = torch.device(device) if device is not None else None
        self.global_params = [torch.nn.Parameter(global_copy(p, self.device), requires_grad=False) for p in params]
        self.optimizer = config.make_outer_optimizer(self.global_params)
        self.sync_every = config.sync_every
        self.delay = config.delay
        self.alpha = float(config.alpha)
        #: ``F``, the number of fragments
        self.fragments = config.fragment_count
        #: the fragment of each parameter (see :func:`fragment_assignment`)
        self.fragment_of = (assign_fragments(self.names, config.fragments) if fragment_of is None
                            else checked_assignment(fragment_of, self.names, self.fragments))
        #: where the ``delay`` overlapped steps lie: ``"after"`` a fragment's step or ``"before"`` it (torchft's)
        self.overlap = config.overlap
        #: inner optimizer steps so far (all windows)
        self.optimizer_steps = 0
        #: fragment synchronisations merged so far
        self.syncs = 0
        #: ``‖Δ̄‖₂`` of the last synchronisation (``nan`` before the first, or when it was not finite)
        self.last_norm = math.nan
        #: per fragment, the inner step at which its last exchange started and the one at which it merged
        self.started_at = [0] * self.fragments
        self.merged_at = [0] * self.fragments
        #: time-boxed windows (``window_seconds``, :mod:`~lightning_gradcomp.local.windows`): each window's
        #: length is this group's own, planned at the previous window's last synchronisation
        self.time_boxed = config.time_boxed
        #: ``W`` in seconds (``window_seconds``; for ``"auto"``, 0 until the first window's plan sets it)
        self.window_seconds = 0.0 if config.window_seconds in (None, "auto") else float(config.window_seconds)
        #: whether ``W`` follows the fastest group's step time (``"auto"``), planned afresh at every window
        self.window_auto = config.window_seconds == "auto"
        #: the current window: the inner step it started after, its length, and the next one's
        self.window_start = 0
        self.window_length = self.sync_every
        self.next_window_length = self.sync_every
        #: windows completed so far (the position every group compares at a synchronisation)
        self.windows = 0
        #: the inner step at which this group's run ends (planned with the others), ``None`` until planned
        self.ends_at: Optional[int] = None

    @property
    def inner_steps(self) -> int:
        """Inner steps since the last synchronisation of the last fragment (the position in the window)."""
        if self.time_boxed:
            return (self.optimizer_steps - self.window_start) % self.window_length
        return self.optimizer_steps % self.sync_every

    @property
    def finished(self) -> bool:
        """Whether a time-boxed run reached the end that every group planned together (see
        :mod:`~lightning_gradcomp.local.windows`)."""
        return self.ends_at is not None and self.optimizer_steps >= self.ends_at

    def members(self, fragment: int) -> list[int]:
        """The indices of the parameters of ``fragment``."""
        return [index for index, owner in enumerate(self.fragment_of) if owner == fragment]

    def count_step(self) -> list[int]:
        """Count one inner optimizer step; the fragments whose exchange starts now (Streaming DiLoCo's
        staggered schedule: fragment ``f`` after steps ``t ≡ (f+1)·H/F (mod H)``, merged ``τ = delay`` steps
        later; with ``overlap="before"``, torchft's, after steps ``t ≡ (f+1)·H/F − τ``, merged after steps
        ``t ≡ (f+1)·H/F``)."""
        self.optimizer_steps += 1
        if self.time_boxed:
            return self._starting_in_window()
        return self.starting_at(self.optimizer_steps)

    def _starting_in_window(self) -> list[int]:
        """:meth:`starting_at` of a time-boxed window of this group's own length ``k``: fragment ``f`` after
        its inner step ``(f+1)·k/F`` (``− τ`` with ``overlap="before"``); the step after the window's last
        one starts the next window, of the length planned meanwhile."""
        position = self.optimizer_steps - self.window_start
        if position > self.window_length:
            self.window_start += self.window_length
            self.window_length = self.next_window_length
            self.windows += 1
            position = self.optimizer_steps - self.window_start
        stride = self.window_length // self.fragments
        lead = self.delay if self.overlap == "before" else 0
        return [f for f in range(self.fragments) if (f + 1) * stride - lead == position]

    def end_window_at_this_step(self) -> bool:
        """Cut the current time-boxed window short so that the coming inner step is its last (its deadline
        passed); whether it was (not a window of fragments, not below ``τ+1`` steps, not the run's last)."""
        position = self.optimizer_steps - self.window_start + 1
        if (not self.time_boxed or self.fragments > 1 or self.ends_at is not None
                or not self.delay < position < self.window_length):
            return False
        self.window_length = position
        return True

    @property
    def window_ended(self) -> bool:
        """Whether the last inner step was the current time-boxed window's last."""
        return self.time_boxed and self.optimizer_steps - self.window_start == self.window_length

    def left_after_window(self, total_steps: Optional[int]) -> int:
        """The inner steps a loop of ``total_steps`` takes after the current window (``-1``: not said)."""
        if total_steps is None:
            return -1
        return max(0, total_steps - (self.window_start + self.window_length))

    def adopt_plan(self, length: int, window_seconds: float, last: bool, ends_now: bool) -> None:
        """The plan made at the current window's last synchronisation: this group's next window of ``length``
        inner steps (``last``: the run ends with it), or the end of the run with the current one."""
        self.window_seconds = window_seconds
        if ends_now:
            self.ends_at = self.window_start + self.window_length
            return
        self.next_window_length = length
        if last:
            self.ends_at = self.window_start + self.window_length + length

    def starting_at(self, step: int) -> list[int]:
        """The fragments whose exchange starts after inner step ``step`` (see :meth:`count_step`)."""
        position = step % self.sync_every
        stride = self.sync_every // self.fragments
        lead = self.delay if self.overlap == "before" else 0
        return [f for f in range(self.fragments) if ((f + 1) * stride - lead) % self.sync_every == position]

    def unsynchronised(self, fragment: int) -> bool:
        """Whether ``fragment``'s parameters moved since the state its last exchange measured: an inner step
        after its last merge (``α = 0``: the merge made the worker's parameters ``θ_global``), or after its
        last start (``α > 0``: the merge kept a share of the overlapped steps)."""
        since = self.started_at[fragment] if self.alpha > 0 else self.merged_at[fragment]
        return self.optimizer_steps > since

    @torch.no_grad()
    def outer_gradients(self, params: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
        """``Δ = θ_global − θ`` of the parameters ``indices`` of one worker's ``params``, flat, in the state
        dtype."""
        return [(self.global_params[i].to(params[i].device, non_blocking=True)
                 - params[i].detach().to(self.global_params[i].dtype)).view(-1) for i in indices]

    @torch.no_grad()
    def apply(self, averaged: Sequence[Tensor], indices: Sequence[int],
              sum_over_shards: Optional[Callable[[Tensor], None]] = None) -> bool:
        """The outer step of the parameters ``indices`` along ``Δ̄`` (flat tensors, one per index; the
        optimizer skips the others, whose gradients are ``None``). Whether it was applied (``False``: ``Δ̄``
        was not finite, the step skipped with a warning). ``sum_over_shards``: for a sharded model, sums a
        tensor in place over the other shards of the replica (a collective), so that every shard skips or
        applies the step alike and :attr:`last_norm` is the model's."""
        self.syncs += 1
        norms = torch.stack([torch.stack(torch._foreach_norm(list(averaged), 2)).square().sum(),
                             torch.stack(torch._foreach_norm(list(averaged), math.inf)).max()])
        if sum_over_shards is not None:  # the other shards' figures: one verdict, one norm, for the model
            sum_over_shards(norms)
        squares, peak = norms.tolist()  # one host read per synchronisation
        norm = math.sqrt(squares) if math.isfinite(squares) else math.nan
        if not math.isfinite(peak):
            self.last_norm = math.nan
            warnings.warn(
                f"gradcomp: the outer gradient of synchronisation {self.syncs} is not finite on some worker; the "
                "outer step is skipped and every worker restarts from the unchanged global parameters (this "
                "window's inner steps are dropped)", RuntimeWarning, stacklevel=3)
            return False
        self.last_norm = norm
        for index, delta in zip(indices, averaged):
            glob = self.global_params[index]
            glob.grad = delta.view_as(glob).to(glob.device)
        self.optimizer.step()
        for index in indices:
            self.global_params[index].grad = None
        return True

    @torch.no_grad()
    def merge(self, params: Sequence[Tensor], indices: Sequence[int], alpha: float) -> None:
        """``θ ← (1 − α)·θ_global + α·θ`` for the parameters ``indices`` (``α = 0``: a copy, cast to each
        parameter's dtype)."""
        for index in indices:
            p, glob = params[index], self.global_params[index]
            if alpha == 0.0:
                p.copy_(glob, non_blocking=True)
            else:
                p.copy_(torch.lerp(glob.to(p.device, non_blocking=True), p.to(glob.dtype), alpha))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """``θ_global`` (CPU copies, by name), the outer optimizer's state, the step counters."""
        return {"global": {name: glob.detach().cpu().clone() for name, glob in zip(self.names, self.global_params)},
                "optimizer": cpu_copy(self.optimizer.state_dict()), "optimizer_steps": self.optimizer_steps,
                "syncs": self.syncs, "sync_every": self.sync_every, "fragments": self.fragments,
                "overlap": self.overlap, "started_at": list(self.started_at), "merged_at": list(self.merged_at),
                "fragment_of": list(self.fragment_of),
                "window": {"seconds": self.window_seconds, "start": self.window_start, "length": self.window_length,
                           "next": self.next_window_length, "windows": self.windows, "ends_at": self.ends_at}}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["global"]
        if sorted(saved) != sorted(self.names):
            missing, unknown = sorted(set(self.names) - set(saved)), sorted(set(saved) - set(self.names))
            raise ValueError(f"gradcomp: the checkpoint's global parameters do not match the model's (missing "
                             f"{missing}, unknown {unknown})")
        saved_fragments = state.get("fragment_of")
        if saved_fragments is not None and list(saved_fragments) != self.fragment_of:
            raise ValueError(
                "gradcomp: the checkpoint's parameters were grouped into other fragments than this run's (the "
                "default grouping of fragments=F became whole blocks after 0.2.0, or `fragments` changed); its "
                "exchanges in flight belong to those. Resume with the same `fragments`, given as the saved lists "
                "of parameter names if need be")
        if saved_fragments is None and self.fragments > 1:
            warnings.warn("gradcomp: the checkpoint predates the record of which parameters form each fragment; "
                          "if it was written with fragments=F by lightning-gradcomp 0.2, whose default grouping was "
                          "modules dealt out in turn, resume with the same grouping given as lists", UserWarning,
                          stacklevel=2)
        for name, glob in zip(self.names, self.global_params):
            glob.copy_(saved[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.syncs = int(state["syncs"])
        for key in ("started_at", "merged_at"):  # absent in checkpoints of 0.9 and before: every fragment due
            saved_steps = state.get(key)
            steps = [int(step) for step in saved_steps] if saved_steps is not None else []
            setattr(self, key, steps if len(steps) == self.fragments else [0] * self.fragments)
        window = state.get("window")
        if window is not None and self.time_boxed:
            self.window_seconds = float(window["seconds"]) if self.window_seconds == 0.0 else self.window_seconds
            self.window_start, self.window_length = int(window["start"]), int(window["length"])
            self.next_window_length, self.windows = int(window["next"]), int(window["windows"])
            self.ends_at = None if window["ends_at"] is None else int(window["ends_at"])
        elif self.time_boxed:  # a lock-step checkpoint: its windows of sync_every steps, the next one afresh
            self.windows = self.optimizer_steps // self.sync_every
            self.window_start = self.windows * self.sync_every
        saved_schedule = (int(state.get("sync_every", self.sync_every)), int(state.get("fragments", self.fragments)),
                          str(state.get("overlap", "after")))
        if saved_schedule != (self.sync_every, self.fragments, self.overlap):
            warnings.warn(f"gradcomp: the checkpoint was written with sync_every, fragments, overlap = {saved_schedule}, "
                          f"this run has {(self.sync_every, self.fragments, self.overlap)}; the step counter "
                          f"({self.optimizer_steps}) is kept and the new schedule follows from it", UserWarning,
                          stacklevel=2)


def global_copy(p: Tensor, device: Optional[torch.device]) -> Tensor:
    """A copy of ``p`` in the state dtype, on ``device`` (``None``: ``p``'s; the CPU for a parameter on an
    accelerator: pinned, so that the copies to and from the accelerator can overlap)."""
    copy = p.detach().to(device=device if device is not None else p.device, dtype=state_dtype(p.dtype), copy=True)
    if copy.device.type == "cpu" and p.device.type != "cpu" and torch.cuda.is_available():
        copy = copy.pin_memory()
    return copy


def buffer_dtype(buffers: Sequence[Tensor]) -> torch.dtype:
    """The dtype buffers are averaged in: fp64 when one of them is, else fp32."""
    return torch.float64 if any(buffer.dtype == torch.float64 for buffer in buffers) else torch.float32


def averaged(buffers: Sequence[Tensor]) -> list[Tensor]:
    """The buffers averaged at each synchronisation: the floating-point ones (BatchNorm statistics);
    integer buffers (``num_batches_tracked``) advance alike on every worker and are left alone."""
    return [buffer for buffer in buffers if buffer.is_floating_point()]


def trainable_parameters(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """The module's parameters that require gradients, by name (what the outer loop synchronises)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


#: the key under which a checkpoint keeps a DTensor's local shard (an inner optimizer's state)
LOCAL_SHARD_KEY = "local_shard"


def cpu_copy(value: Any, local_shards: bool = False) -> Any:
    """``value`` with every tensor copied to the CPU (an optimizer's state dict holds its live tensors);
    ``local_shards``: a DTensor as its local shard, ``{LOCAL_SHARD_KEY: tensor}`` (this rank's part)."""
    if local_shards and isinstance(value, Tensor) and callable(getattr(value, "to_local", None)):
        return {LOCAL_SHARD_KEY: value.to_local().detach().cpu().clone()}
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: cpu_copy(item, local_shards) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(item, local_shards) for item in value)
    return value
