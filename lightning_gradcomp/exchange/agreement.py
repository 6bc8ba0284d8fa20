"""The ranks of an exchange agree on what shapes the wire, checked once when the session is built.

Two ranks that exchange with different settings (another compressor or density, another
``min_compress_numel``, another shard layout, another ``H``) issue collectives of different sizes or in a
different order: gloo aborts the process ("Received data size doesn't match expected size"), waits until
its timeout, or pairs the wrong payloads and trains on a silent mix. :func:`check_agreement` compares the
settings of every rank of the exchange's group before any payload moves: one all-gather of two 64-bit
integers per rank (a fingerprint of the settings and their number), waited for at most
``GRADCOMP_WAIT_TIMEOUT`` seconds (:mod:`~lightning_gradcomp.exchange.waits`: a rank that never registers
is named). Where they differ, every rank
gathers every rank's settings (a second, small collective that only a mismatch costs) and raises the same
:class:`SettingsMismatch`, naming each setting that differs and every rank's value.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.exchange.waits import Arrival

#: a value longer than this is cut in the message (a shard layout of a large model)
_SHOWN = 160


class SettingsMismatch(ValueError):
    """The ranks of one exchange were given different settings; raised on every rank of the exchange."""


class ScheduleMismatch(RuntimeError):
    """The ranks of one exchange reached different synchronisations (a rank called ``sync()`` alone, or
    counted other steps); raised on every rank before any payload moves."""


def out_of_step(rows: list[tuple[int, ...]]) -> list[int]:
    """The ranks whose row differs from the most common one (every rank's, when no row is the majority's)."""
    counts: dict[tuple[int, ...], int] = {}
    for row in rows:
        counts[row] = counts.get(row, 0) + 1
    common, count = max(counts.items(), key=lambda item: item[1])
    if count * 2 <= len(rows):
        return list(range(len(rows)))
    return [rank for rank, row in enumerate(rows) if row != common]


def fingerprint(settings: Mapping[str, str]) -> int:
    """A 63-bit digest of ``settings`` (names and values, in sorted order), the same on every machine."""
    text = "\n".join(f"{name}={settings[name]}" for name in sorted(settings))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_agreement(settings: Mapping[str, str], group: Optional[dist.ProcessGroup] = None, *,
                    caller: str = "gradcomp") -> None:
    """Raise :class:`SettingsMismatch` on every rank of ``group`` unless all hold the same ``settings``
    (``name -> value`` as text). Every rank of ``group`` calls it at the same point; nothing happens without
    ``torch.distributed`` or with one rank. ``caller`` names the entry point in the message."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == dist.Backend.NCCL else torch.device("cpu")
    mine = torch.tensor([fingerprint(settings), len(settings)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    arrival = Arrival(caller, group, "every rank's settings",
                      f"a script that calls {caller} on some ranks only (e.g. under `if rank == 0`) must call it on "
                      "every rank")
    arrival.wait(dist.all_gather(everyone, mine, group=group, async_op=True))
    if all(torch.equal(theirs, mine) for theirs in everyone):  # at registration, not in a step: the host reads
        return
    gathered: list[Any] = [None] * len(everyone)
    dist.all_gather_object(gathered, dict(settings), group=group)
    raise SettingsMismatch(describe_mismatch(gathered, caller))


def model_layout(model: torch.nn.Module) -> dict[str, str]:
    """A model's trainable parameters as settings to agree on: their number and elements (what the message
    shows first) and every name and shape."""
    named = [(name, tuple(parameter.shape)) for name, parameter in model.named_parameters() if parameter.requires_grad]
    elements = sum(math.prod(shape) for _, shape in named)
    return {"model": f"{len(named)} trainable parameters, {elements:,} elements",
            "parameter shapes": ";".join(f"{name}{shape}" for name, shape in named)}


#: what to do about a setting that differs, where it is not "pass the same value" (shown after its values)
SETTING_ADVICE = {
    "entry point": "call the same entry point on every rank",
    "FSDP modules": "apply fully_shard to the same modules on every rank",
    "shard layout": "shard the same model over the same mesh on every rank",
    "model": "build the same model on every rank",
    "parameter shapes": "build the same model on every rank",
    "checkpoint path": "every rank saves the same checkpoint: pass the same path on every rank",
    "checkpoint parts": "each rank reads its own part of the exchange state from the checkpoint's gradcomp folder: "
                        "copy the checkpoint with that folder where every rank can read it",
}


def describe_mismatch(per_rank: list[Mapping[str, str]], caller: str) -> str:
    """The message of :class:`SettingsMismatch`: each setting whose values differ, with the ranks holding each
    value (ranks of the exchange's group)."""
    names = list(dict.fromkeys(name for settings in per_rank for name in settings))
    lines = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            holders.setdefault(settings.get(name, "(not set)"), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{_shown(value)} on {_ranks(ranks)}" for value, ranks in holders.items())
            advice = f" ({SETTING_ADVICE[name]})" if name in SETTING_ADVICE else ""
            lines.append(f"`{name}`: {values}{advice}")
    return (f"gradcomp: {caller}: the ranks of this exchange were given different settings, which would abort, hang "
            f"or mix their collectives: {' | '.join(lines)}. Every rank must pass the same settings (build them from "
            "the same configuration on every rank; a value derived from the rank, a host name or a random draw "
            "differs)")


def describe_optimizer_factory(factory: Any) -> str:
    """A description of an outer-optimizer factory that is the same on every rank: what it builds and with
    which arguments (``functools.partial(torch.optim.SGD, lr=1.0)`` -> ``torch.optim.sgd.SGD(lr=1.0)``), never
    an object's address."""
    if factory is None:
        return "DiLoCo's SGD(lr=0.7, momentum=0.9, nesterov=True)"
    if isinstance(factory, functools.partial):
        arguments = [repr(arg) for arg in factory.args] + [f"{k}={v!r}" for k, v in sorted(factory.keywords.items())]
        return f"{describe_optimizer_factory(factory.func)}({', '.join(arguments)})"
    named = factory if hasattr(factory, "__qualname__") else type(factory)
    return f"{getattr(named, '__module__', '')}.{named.__qualname__}"


def _shown(value: str) -> str:
    return value if len(value) <= _SHOWN else f"{value[:_SHOWN]}... ({len(value)} characters)"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
