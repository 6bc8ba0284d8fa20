"""The options of local-update training (DiLoCo and its family), validated in one place.

Local updates (Lin et al. 2020, "Don't use large mini-batches, use local SGD"; Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105): every worker
takes ``sync_every = H`` optimizer steps alone, with its own inner optimizer; then the workers exchange
the *outer gradient* ``Δ_w = θ_global − θ_w`` through the exchange engine (any compressor, error
feedback on ``Δ``), and an outer optimizer steps ``θ_global`` along the average ``Δ̄``::

    θ_global ← OuterOpt(θ_global, Δ̄)          DiLoCo: SGD, lr 0.7, momentum 0.9, Nesterov
    θ_w      ← θ_global                      every worker continues from the new global parameters

With ``H = 1`` and outer SGD at lr 1 without momentum, ``θ_global − Δ̄`` is the average of the workers'
parameters after one step: the per-step exchange of ``lr·g`` (see ``tests/test_local_updates.py``).

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv
2501.18512): the parameters are split into ``F`` fragments that synchronise on a staggered schedule,
fragment ``f`` around inner steps ``t ≡ (f+1)·H/F (mod H)``; the exchange of a fragment overlaps ``τ =
delay`` inner steps (it runs on the exchange thread), and its result is merged as ``θ_f ← (1 − α)·θ_global,f
+ α·θ_f`` with the worker's parameters of that moment. ``F = 1``, ``τ = 0`` is DiLoCo. The paper sends
outer gradients as 4-bit floats (``compressor="fp4"``) accumulated in fp32.

The fragments and where the overlapped steps lie: see :class:`LocalUpdates`.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.exchange.agreement import describe_optimizer_factory

#: builds the outer optimizer from the global parameters, e.g. ``functools.partial(torch.optim.SGD, lr=1.0)``
OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]

#: one entry of a user-given fragment: a module's name (``"layers.0"``: the parameters whose names are it or
#: start with it and a dot; a parameter's own name also works) or the module itself (plain PyTorch)
FragmentEntry = Union[str, torch.nn.Module]

#: ``fragments``: their number ``F``, or the fragments themselves, each a list of entries (or one entry)
Fragments = Union[int, Sequence[Union[FragmentEntry, Sequence[FragmentEntry]]]]

#: ``overlap``: where the ``delay`` overlapped inner steps lie relative to a fragment's step (1 below)
OVERLAPS = ("after", "before")

#: ``weight_by``: what each group's outer gradient is weighted by when merged (``None``: equally)
WEIGHTS = ("samples", "tokens", None)

#: ``window_seconds``: derive the window's length from ``sync_every`` and the fastest group's step time
AUTO_WINDOW = "auto"

#: DiLoCo's outer optimizer (Douillard et al. 2023, §3): SGD with Nesterov momentum
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9


def diloco_outer_optimizer(params: Iterable[Tensor]) -> Optimizer:
    """DiLoCo's outer optimizer: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``."""
    return torch.optim.SGD(params, lr=DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM, nesterov=True)


def check_outer_optimizer(factory: OuterOptimizerFactory) -> None:
    """Build the outer optimizer once on a one-element parameter and check its settings before training: it
    must be a ``torch.optim.Optimizer`` whose learning rate is finite and ``>= 0`` and whose momentum, if any,
    is in ``[0, 1)`` (a NaN ``lr`` made θ_global NaN at the first synchronisation). Torch's own refusals name
    the outer optimizer. A factory that cannot build on such a parameter is left to fail where it is used."""
    try:
        probe = factory([torch.zeros(1, requires_grad=True)])
    except ValueError as error:
        raise ValueError(f"`outer_optimizer`: building the outer optimizer failed: {error} (these are the outer "
                         "optimizer's settings, applied to θ_global at each synchronisation, not the inner "
                         "optimizer's)") from error
    except Exception:  # noqa: BLE001 - a factory that needs the real parameters (named groups): checked there
        return
    if not isinstance(probe, Optimizer):
        raise ValueError(f"`outer_optimizer` must build a torch.optim.Optimizer, e.g. functools.partial("
                         f"torch.optim.SGD, lr=1.0); it built a {type(probe).__name__}")
    for group in probe.param_groups:
        for key, low, high, allowed in (("lr", 0.0, math.inf, ">= 0 (DiLoCo's is 0.7, SparseLoCo's 1.0)"),
                                        ("momentum", 0.0, 1.0, "in [0, 1) (DiLoCo's is 0.9)")):
            value = group.get(key)
            if value is None or isinstance(value, bool):
                continue
            number = float(value)
            if not math.isfinite(number) or not low <= number < high:
                raise ValueError(f"`outer_optimizer`: the outer optimizer's {key} must be finite and {allowed}, "
                                 f"got {value!r} (the inner optimizer's is the training loop's own)")


@dataclass(frozen=True)
class LocalUpdates:
    """Synchronise every ``sync_every`` optimizer steps instead of every step.

    Args:
        sync_every: ``H``, the number of inner optimizer steps between two synchronisations (1 or more).
        outer_optimizer: builds the outer optimizer from the global parameters (any ``torch.optim``
            optimizer, e.g. ``functools.partial(torch.optim.SGD, lr=1.0)`` for SparseLoCo's plain outer
            SGD); ``None`` (default): DiLoCo's ``SGD(lr=0.7, momentum=0.9, nesterov=True)``.

        fragments: the fragments of Streaming DiLoCo (1, default: the whole model at once). An int ``F``:
            strided groups of whole blocks, as the paper's: the blocks of the model's stacks of repeated
            blocks (each ``ModuleList`` / ``Sequential`` / ``ModuleDict`` whose children holding trainable
            parameters are two or more of one class, outermost stacks only, in registration order) go to
            fragment ``i mod F`` (block ``i``); the parameters registered before the first block
            (embeddings) go to fragment 0, the others (final norm, output layer) to fragment ``F − 1``. A
            model without such stacks, with fewer than ``F`` blocks, or whose blocks hold fewer than half its
            modules with trainable parameters falls back to its modules dealt out in turn (module ``i`` to
            fragment ``i mod F``, in registration order: the earlier default). A list: the fragments
            themselves, each a list of modules or of module names (``[["embed", "layers.0", "layers.2"],
            ["layers.1", "layers.3", "norm", "head"]]``; names suit configs and survive pickling, modules
            are matched by identity); every trainable parameter must belong to exactly one fragment.
            ``sync_every`` must be a multiple of the number of fragments.
        delay: ``τ``, the inner steps a fragment's exchange overlaps before its result is merged (0: merged
            at once); less than ``sync_every / F``.
        overlap: where the ``τ`` overlapped steps lie. ``"after"`` (default): fragment ``f``'s exchange
            starts after inner step ``(f+1)·H/F`` of each window (``H = sync_every``) and is merged ``τ``
            steps later, the last fragment's in the next window. ``"before"``: torchft's schedule
            (``torchft.local_sgd.DiLoCo(fragment_sync_delay=τ)``, the same fragment order, outer gradients
            and merge): the exchange starts ``τ`` steps before step ``(f+1)·H/F`` and is merged after it, so
            all of a window's merges happen within that window. Both are the paper's algorithm up to this
            offset; they are the same schedule when ``τ = 0``.
        alpha: ``α`` in ``[0, 1]``, the share of the worker's own parameters kept when a result is merged
            (0: every worker continues from the global parameters, dropping its ``τ`` overlapped steps'
            progress on that fragment).
        window_seconds: time-boxed windows (:mod:`~lightning_gradcomp.local.windows`, after Decoupled DiLoCo):
            ``None`` (default): lock-step, every group takes ``sync_every`` inner steps per window. A number of
            seconds, or ``"auto"`` (``sync_every`` times the fastest group's step time, measured in the last
            window: the fastest group takes ``sync_every`` steps): each group takes as many inner steps as fit
            in that window at its own measured speed, so that a slow group no longer holds up the others; the
            ranks of a group take the same number. The first window is lock-step (it measures the speeds).
        weight_by: what each group's outer gradient is weighted by in the merge, ``Δ = Σ_m w_m·Δ_m`` with
            ``w_m = n_m / Σ n``: ``"samples"`` (default: the inner steps it took, or the samples reported with
            :meth:`~lightning_gradcomp.local.handle.LocalUpdateHandle.count`), ``"tokens"`` (reported with
            ``count(tokens)`` on every inner step), or ``None`` (equal weights, the plain average). Equal
            counts give weights of exactly 1: a lock-step run is the same bit for bit.

    Between two synchronisations nothing is communicated: no gradient all-reduce and no buffer
    broadcast. At a synchronisation floating-point buffers (BatchNorm statistics) are averaged, dense
    (with fragments, each module's buffers with its fragment).
    """

    sync_every: int = 100
    outer_optimizer: Optional[OuterOptimizerFactory] = None
    fragments: Fragments = 1
    delay: int = 0
    alpha: float = 0.0
    overlap: Literal["after", "before"] = "after"
    window_seconds: Union[None, float, Literal["auto"]] = None
    weight_by: Optional[Literal["samples", "tokens"]] = "samples"

    def __post_init__(self) -> None:
        check_int(self.sync_every, "sync_every", 1)
        object.__setattr__(self, "fragments", check_fragments(self.fragments))
        count = self.fragment_count
        if self.sync_every % count:
            given = count if isinstance(self.fragments, int) else f"{count} fragments given"
            raise ValueError(f"`sync_every` ({self.sync_every}) must be a multiple of `fragments` ({given}), so that "
                             "the fragments synchronise at evenly spaced steps")
        check_int(self.delay, "delay", 0, self.sync_every // count - 1)
        if self.overlap not in OVERLAPS:
            raise ValueError(f"`overlap` must be 'after' (a fragment's exchange starts after its step and is merged "
                             "`delay` steps later) or 'before' (torchft's schedule: it starts `delay` steps before "
                             f"its step and is merged after it), got {self.overlap!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"`alpha` must be a number in [0, 1], got {self.alpha!r}")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ValueError("`outer_optimizer` must be None (DiLoCo's Nesterov SGD) or a callable that builds a "
                             "torch.optim.Optimizer from the parameters, e.g. functools.partial(torch.optim.SGD, "
                             f"lr=1.0); got {self.outer_optimizer!r}")
        if self.outer_optimizer is not None:
            check_outer_optimizer(self.outer_optimizer)
        window = self.window_seconds
        if window is not None and window != AUTO_WINDOW and (
                isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window < math.inf):
            raise ValueError("`window_seconds` must be None (lock-step windows of `sync_every` inner steps), a number "
                             "of seconds > 0 (each group takes the inner steps that fit), or 'auto' (sync_every "
                             f"times the fastest group's step time in the first window); got {window!r}")
        if self.weight_by not in WEIGHTS:
            raise ValueError("`weight_by` must be 'samples' (each group's outer gradient weighted by the samples it "
                             "processed in the window: its inner steps, or what handle.count() reported), 'tokens' "
                             f"(reported with handle.count(tokens)) or None (equal weights); got {self.weight_by!r}")

    @property
    def time_boxed(self) -> bool:
        """Whether each group takes the inner steps that fit in a time box (``window_seconds``)."""
        return self.window_seconds is not None

    def settings(self) -> dict[str, str]:
        """What of the schedule shapes the exchange, as text the same on every rank (the ranks of an exchange
        must agree on it: :func:`~lightning_gradcomp.exchange.agreement.check_agreement`)."""
        fragments = self.fragments if isinstance(self.fragments, int) else [
            [entry if isinstance(entry, str) else type(entry).__name__ for entry in fragment]
            for fragment in self.fragments]
        settings = {"sync_every": str(self.sync_every), "fragments": str(fragments), "delay": str(self.delay),
                    "alpha": str(self.alpha), "overlap": self.overlap,
                    "outer_optimizer": describe_optimizer_factory(self.outer_optimizer)}
        if self.time_boxed:  # the defaults add nothing: the settings of earlier runs compare as they did
            settings["window_seconds"] = str(self.window_seconds)
        if self.weight_by != "samples":
            settings["weight_by"] = str(self.weight_by)
        return settings

    @property
    def fragment_count(self) -> int:
        """``F``, the number of fragments."""
        return self.fragments if isinstance(self.fragments, int) else len(self.fragments)

    def make_outer_optimizer(self, params: list[Tensor]) -> Optimizer:
        """The outer optimizer over the global parameters ``params``."""
        factory = self.outer_optimizer or diloco_outer_optimizer
        optimizer = factory(params)
        if not isinstance(optimizer, Optimizer):
            raise ValueError("`outer_optimizer` must build a torch.optim.Optimizer; it built "
                             f"{type(optimizer).__name__}")
        return optimizer


def check_fragments(value: object) -> Union[int, tuple[tuple[FragmentEntry, ...], ...]]:
    """``fragments`` validated: an int ``F >= 1``, or a tuple of fragments, each a non-empty tuple of module
    names (non-empty strings) or modules (a fragment given as one name or module is a fragment of one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return check_int(value, "fragments", 1)
    allowed = ("`fragments` must be an integer >= 1 (the number of fragments) or a list of fragments, each a list "
               "of module names (strings such as 'layers.0') or modules")
    if isinstance(value, (str, bytes, torch.nn.Module)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{allowed}; got {value!r}")
    fragments = []
    for index, fragment in enumerate(value):
        entries = (fragment,) if isinstance(fragment, (str, torch.nn.Module)) else fragment
        if isinstance(entries, bytes) or not isinstance(entries, Sequence) or not entries:
            raise ValueError(f"{allowed}; fragment {index} is {fragment!r}")
        for entry in entries:
            if isinstance(entry, str) and not entry:
                raise ValueError(f"{allowed}; fragment {index} holds an empty name (a module's name, e.g. "
                                 "'layers.0'; the whole model at once is fragments=1)")
            if not isinstance(entry, (str, torch.nn.Module)):
                raise ValueError(f"{allowed}; fragment {index} holds {entry!r}")
        fragments.append(tuple(entries))
    return tuple(fragments)


def check_local_updates(value: object) -> Optional[LocalUpdates]:
    """``None``, a :class:`LocalUpdates`, or an int ``H`` (``LocalUpdates(sync_every=H)``)."""
    if value is None or isinstance(value, LocalUpdates):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return LocalUpdates(sync_every=value)
    raise ValueError(f"`local_updates` must be None (synchronise every step), a LocalUpdates(...) or an int H "
                     f"(synchronise every H optimizer steps); got {value!r}")


def warn_compounding_momentum(compressor: object, config: LocalUpdates) -> None:
    """Warn when the compressor keeps a momentum of its own (its ``check_optimizer`` refuses an optimizer with
    one: DGC, DeMo, Signum) and the outer optimizer adds another (DiLoCo's Nesterov momentum, the default): the
    two compound on the outer gradients. (Checked on a copy of the compressor: checking binds DeMo.)"""
    try:
        probe = config.make_outer_optimizer([torch.zeros(1, requires_grad=True)])
    except Exception:  # noqa: BLE001 - a factory that needs the real parameters: nothing to compare
        return
    try:
        copy.deepcopy(compressor).check_optimizer(probe)
    except ValueError as conflict:
        warnings.warn(
            f"gradcomp: local updates with {compressor!r} and the outer optimizer "
            f"{describe_optimizer_factory(config.outer_optimizer)}: {conflict}. Under local updates this is the "
            "outer optimizer: the compressor's momentum and the outer one compound on the outer gradients. "
            "SparseLoCo's and DeMo's authors use plain outer SGD: outer_optimizer=functools.partial("
            "torch.optim.SGD, lr=1.0)", UserWarning, stacklevel=3)

