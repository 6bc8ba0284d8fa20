"""``θ_global`` as the model: what evaluation, checkpoints and the end of training see under local updates.

Between two synchronisations every worker holds its own replica ``θ_w``; the model DiLoCo defines,
evaluates and ships is ``θ_global`` (Douillard et al. 2023, Algorithm 1), the same on every worker. The
outer loops (:class:`~lightning_gradcomp.local.loop.LocalUpdateLoop`,
:class:`~lightning_gradcomp.local.simulated.SimulatedLocalUpdates`) keep ``θ_global`` in fp32 and the
buffers of the last synchronisation (:class:`GlobalBuffers`); :class:`SwappedIn` puts them into the module
for a while, by reference (no copy for fp32 parameters, no communication), and puts the replica back;
:class:`CopiedIn` does the same by copying, where the module's tensors cannot be pointed elsewhere (the
local shards of an FSDP2 model, whose all-gathers read FSDP's own storage) or ``θ_global`` lives on
another device (host memory).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor


class _ShownValues:
    """What :class:`SwappedIn` and :class:`CopiedIn` share: :meth:`restore` gives the tensors their own
    values back, :meth:`_show` (re)applies the values, keeping the tensors' own first; both are the subclass's."""

    def __init__(self, tensors: Sequence[Tensor], values: Sequence[Optional[Tensor]]) -> None:
        self.tensors = list(tensors)
        self.values = list(values)
        self.kept: list[Optional[Tensor]] = [None] * len(self.tensors)
        self._show()

    @contextmanager
    def own_data(self) -> Iterator[None]:
        """Inside, the tensors hold their own values (what is written into them is kept); afterwards the
        values again."""
        self.restore()
        try:
            yield
        finally:
            self._show()


class SwappedIn(_ShownValues):
    """Tensors (parameters, buffers) pointed at other values while the swap lasts: each tensor's ``.data``
    is its value (cast to the tensor's dtype where they differ, a copy), so ``module.state_dict()`` and
    every forward see it; :meth:`restore` points each at its own data again. ``None`` values leave their
    tensors alone. The values are shared, not copied: nothing may write into the tensors meanwhile.

    :meth:`own_data` puts the tensors' own data back for a while (a checkpoint of the replica taken while
    ``θ_global`` is shown)."""

    def _show(self) -> None:
        self.kept = [tensor.data for tensor in self.tensors]
        for tensor, value in zip(self.tensors, self.values):
            if value is not None:
                tensor.data = value.detach() if value.dtype == tensor.dtype else value.detach().to(tensor.dtype)

    def restore(self) -> None:
        """Every tensor holds its own data again."""
        for tensor, data in zip(self.tensors, self.kept):
            tensor.data = data


class CopiedIn(_ShownValues):
    """:class:`SwappedIn`'s contract by copying: the tensors' own values are kept aside (one copy each), the
    values copied in (cast to each tensor's dtype and device), and :meth:`restore` copies the kept values
    back. For tensors whose storage others read (FSDP2's sharded parameters: its all-gathers read its own
    padded storage, of which the local shard is a view) and values on another device."""

    @torch.no_grad()
    def _show(self) -> None:
        for index, (tensor, value) in enumerate(zip(self.tensors, self.values)):
            if value is not None:
                self.kept[index] = tensor.detach().clone()
                tensor.copy_(value)

    @torch.no_grad()
    def restore(self) -> None:
        """Every tensor holds its own values again."""
        for tensor, kept in zip(self.tensors, self.kept):
            if kept is not None:
                tensor.copy_(kept)
        self.kept = [None] * len(self.tensors)


class GlobalBuffers:
    """The buffers of ``θ_global``: each floating-point buffer as of its fragment's last synchronisation
    (the workers' average); integer buffers (``num_batches_tracked``) advance alike on every worker and are
    the worker's own (``None`` here).

    Args:
        buffers: the module's buffers, whose values now (the same on every worker) start the record.
        fragment_of: each buffer's fragment.
    """

    def __init__(self, buffers: Sequence[Tensor], fragment_of: Sequence[int]) -> None:
        self.values: list[Optional[Tensor]] = [buffer.detach().clone() if buffer.is_floating_point() else None
                                               for buffer in buffers]
        self.fragment_of = list(fragment_of)

    @torch.no_grad()
    def record(self, fragment: int, buffers: Sequence[Tensor]) -> None:
        """Keep ``fragment``'s buffers (all of the module's, in order), just averaged."""
        for value, buffer, owner in zip(self.values, buffers, self.fragment_of):
            if value is not None and owner == fragment:
                value.copy_(buffer)

    @torch.no_grad()
    def copy_into(self, buffers: Sequence[Tensor], fragment: Optional[int] = None) -> None:
        """Write the recorded values into ``buffers`` (all of the module's, in order; only ``fragment``'s
        when given)."""
        for value, buffer, owner in zip(self.values, buffers, self.fragment_of):
            if value is not None and fragment in (None, owner):
                buffer.copy_(value)

    def state_dict(self) -> list[Optional[Tensor]]:
        return [value.detach().cpu().clone() if value is not None else None for value in self.values]

    @torch.no_grad()
    def load_state_dict(self, state: Optional[list[Any]]) -> None:
        """Restore a :meth:`state_dict` (``None``, from a checkpoint written before it existed: keep the
        values the module was built with, which are the checkpoint's model buffers)."""
        if state is None:
            return
        if len(state) != len(self.values):
            raise ValueError(f"gradcomp: the checkpoint holds {len(state)} global buffers, the model has "
                             f"{len(self.values)}")
        for value, saved in zip(self.values, state):
            if value is not None and saved is not None:
                value.copy_(saved)
