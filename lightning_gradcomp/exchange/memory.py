"""Per-worker memory of the compression: error-feedback residuals and compressor state.

Error feedback (Seide et al. 2014; Stich et al. 2018; Sahu et al. 2021, Alg. 1)::

    p_t     = g_t + e_t          (compensate)
    send      C(p_t)
    e_{t+1} = p_t - C(p_t)       (update)

so that ``C(p_t) + e_{t+1} == p_t``. For sparsifiers the invariant holds bit for bit: the residual is
``p_t`` with the sent coordinates set to exactly zero.

Residuals and compressor state are kept in fp32 (fp64 for fp64 gradients) whatever the gradient's dtype
(:func:`~lightning_gradcomp.core.device.state_dtype`; with bf16 or fp16 a small gradient added to a larger
residual would round away); ``p_t`` is formed in that dtype, only what is sent is cast. Everything is keyed
by parameter *name* (DDP rebuilds its buckets after the first step) and is part of the checkpoint; a
parameter whose gradient is not finite keeps its residual as it was. A bucket compressed whole finds its
residuals and state in one flat buffer whose views are the per-name ones
(:meth:`CompressionMemory.compensate_bucket`, :meth:`CompressionMemory.bucket_state`), rebuilt only when
the layout changes. On CPU ``p_t`` goes into a buffer kept from the previous step (a fresh large allocation
costs page faults), and the previous residual stays intact until the exchange is done, so a step made void
afterwards keeps it exactly; on accelerators no buffer is kept.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.device import state_dtype
from lightning_gradcomp.core.segments import Segments
from lightning_gradcomp.core.tensors import Finite, keep_if_finite


class CompressionMemory:
    """Residuals (error feedback) and per-parameter compressor state of one worker."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}
        self.states: dict[str, dict[str, Tensor]] = {}
        self._spares: dict[str, Tensor] = {}  # CPU only: next step's buffer for p (see the module docstring)
        # flat buffers of whole buckets: (what, layout) -> (buffer, the views handed out by name)
        self._flats: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
        self._bucket_spares: dict[tuple, Tensor] = {}

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        """``p = g + e`` in a tensor of its own (a kept buffer on CPU), in fp32 (fp64 for fp64
        gradients); ``grad`` and ``e`` are not modified."""
        residual = self.residuals.get(name)
        spare = self._spares.pop(name, None)
        dtype = state_dtype(grad.dtype)
        if spare is None or spare.shape != grad.shape or spare.dtype != dtype or spare.device != grad.device:
            spare = torch.empty_like(grad, dtype=dtype, memory_format=torch.contiguous_format)
        if residual is None or residual.shape != grad.shape:
            return spare.copy_(grad)
        return torch.add(residual, grad, out=spare)

    def update(self, name: str, corrected: Tensor, subtract: Callable[[Tensor], None], finite: Finite = True
               ) -> Optional[Tensor]:
        """Store ``e = p - C(p)``, unless the gradient was not finite (then the residual stays as it was).

        ``corrected`` (``p``) is consumed: ``subtract`` (``p -= C(p)``, the exchange's
        :class:`~lightning_gradcomp.core.protocol.Outcome`) runs in its storage. Returns the new
        residual, or ``None`` when it was left unchanged.
        """
        if finite is False:
            self._keep_spare(self._spares, name, corrected)
            return None
        subtract(corrected)
        previous = self.residuals.get(name)
        residual = keep_if_finite(corrected, previous, finite, in_place=True)
        self.residuals[name] = residual
        if residual is corrected and previous is not None:
            self._keep_spare(self._spares, name, previous)
        return residual

    # ------------------------------------------------------------------ whole buckets
    def compensate_bucket(self, segments: Segments, grads: Sequence[Tensor]) -> Tensor:
        """``p = g + e`` of every tensor of a bucket, in one flat buffer laid out by ``segments`` (fp32,
        or fp64 for fp64 gradients; gaps zero): one ``cat`` and one ``add``; one ``add`` alone for a lone
        tensor without a gap (a large layer filling a bucket: one pass over it, not two)."""
        dtype = state_dtype(grads[0].dtype)
        device = grads[0].device
        residual = self._flat(self.residuals, ("residual", segments.key), segments, dtype, device)
        spare = self._bucket_spares.pop(segments.key, None)
        if spare is None or spare.numel() != segments.total or spare.dtype != dtype or spare.device != device:
            spare = None
        if residual is not None and residual.dtype == dtype and len(grads) == 1 and not segments.padded:
            return torch.add(grads[0].reshape(-1), residual, out=spare)  # promotes 16-bit gradients as a cast would
        corrected = segments.gather(grads, dtype, out=spare)
        return corrected if residual is None else corrected.add_(residual)

    def update_bucket(self, segments: Segments, corrected: Tensor, subtract: Callable[[Tensor], None],
                      finite: Finite = True, gaps_stay_zero: bool = False) -> Optional[Tensor]:
        """:meth:`update` for a whole bucket: ``e = p - C(p)`` in the storage of the flat ``p`` (``finite``:
        the bucket's verdict; ``gaps_stay_zero``: ``subtract`` leaves the gaps zero). The per-name residuals
        become views of it."""
        if finite is False:
            self._keep_spare(self._bucket_spares, segments.key, corrected)
            return None
        subtract(corrected)
        if not gaps_stay_zero:
            segments.zero_gaps(corrected)
        key = ("residual", segments.key)
        previous = self._flat(self.residuals, key, segments, corrected.dtype, corrected.device)
        residual = keep_if_finite(corrected, previous, finite, in_place=True)
        self._adopt(self.residuals, key, segments, residual)
        if residual is corrected and previous is not None:
            self._keep_spare(self._bucket_spares, segments.key, previous)
        return residual

    def bucket_state(self, segments: Segments, key: str, dtype: torch.dtype, device: torch.device,
                     shaped: bool = False) -> Optional[Tensor]:
        """The compressor state ``key`` of every tensor of a bucket as one flat buffer (views of it are the
        per-name states, of ``segments.shapes`` if ``shaped``, else 1-D), or ``None`` when no tensor of the
        bucket has it. Missing tensors' parts are zero."""
        states = _StateColumn(self.states, key)
        return self._flat(states, ("state", key, segments.key), segments, dtype, device, shaped)

    def set_bucket_state(self, segments: Segments, key: str, flat: Tensor, shaped: bool = False) -> None:
        """Keep ``flat`` as the state ``key`` of every tensor of a bucket (per-name views of it)."""
        self._adopt(_StateColumn(self.states, key), ("state", key, segments.key), segments, flat, shaped)

    def _flat(self, store: Any, key: tuple, segments: Segments, dtype: torch.dtype,
              device: torch.device, shaped: bool = False) -> Optional[Tensor]:
        """The flat buffer whose views ``store`` holds for ``segments``' names, rebuilt from ``store``
        (with zeros where it holds nothing) when the views are not the ones handed out; ``None`` when
        ``store`` holds nothing for these names."""
        kept = self._flats.get(key)
        if kept is not None and all(store.get(name) is view for name, view in zip(segments.names, kept[1])):
            return kept[0]
        values = [store.get(name) for name in segments.names]
        if all(value is None for value in values):
            self._flats.pop(key, None)
            return None
        flat = torch.zeros(segments.total, dtype=dtype, device=device)
        for value, target, shape in zip(values, segments.views(flat), segments.shapes):
            if state_fits(value, shape, target.numel(), shaped):
                target.copy_(value.reshape(-1))
        self._adopt(store, key, segments, flat, shaped)
        return flat

    def _adopt(self, store: Any, key: tuple, segments: Segments, flat: Tensor, shaped: bool = False) -> None:
        """Hand out ``flat``'s views by name; forget the flat buffers of other layouts of the same kind
        that shared a name (DDP rebuilt its buckets: they would hold a stale copy)."""
        views = segments.views(flat)
        if shaped:
            views = [view.view(shape) for view, shape in zip(views, segments.shapes)]
        for name, view in zip(segments.names, views):
            store[name] = view
        names = set(segments.names)
        for other in [other for other in self._flats if other[:-1] == key[:-1] and other != key
                      and names.intersection(other[-1][0])]:
            del self._flats[other]
            self._bucket_spares.pop(other[-1], None)
        self._flats[key] = (flat, views)

    @staticmethod
    def _keep_spare(spares: dict, key: Any, buffer: Tensor) -> None:
        if buffer.device.type == "cpu":
            spares[key] = buffer

    def state(self, name: str) -> dict[str, Tensor]:
        """The mutable compressor state of one parameter (created empty)."""
        return self.states.setdefault(name, {})

    def clear(self) -> None:
        self.residuals.clear()
        self.states.clear()
        self._spares.clear()
        self._flats.clear()
        self._bucket_spares.clear()

    def squared_residual_norm(self) -> float:
        """``sum ||e||^2`` over all parameters."""
        return float(sum(float(r.double().pow(2).sum()) for r in self.residuals.values()))

    def state_dict(self) -> dict[str, Any]:
        """CPU copies, safe for ``torch.load(weights_only=True)``."""
        return {
            "residuals": {name: r.detach().cpu().clone() for name, r in self.residuals.items()},
            "states": {name: {k: v.detach().cpu().clone() for k, v in s.items()} for name, s in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self._spares.clear()
        self._flats.clear()
        self._bucket_spares.clear()
        # copies even on the same device: buffers of the memory are reused in place (the spares of p, a
        # residual selected into p's storage), which must not write into the caller's state dict
        self.residuals = {name: r.to(device, copy=True) for name, r in state.get("residuals", {}).items()}
        self.states = {
            name: {k: v.to(device, copy=True) for k, v in s.items()} for name, s in state.get("states", {}).items()
        }


def state_fits(value: Optional[Tensor], shape: tuple[int, ...], numel: int, shaped: bool) -> bool:
    """Whether a kept state is one of a tensor of ``shape`` and ``numel`` elements: of that shape if
    ``shaped``, else 1-D of ``numel`` elements. Another shape is none, as per tensor: a shaped state's
    (DeMo's tiles after a change of `chunk`), or a flat one held with more dimensions (DeMo's tiles of a
    tensor now sent dense)."""
    return value is not None and (tuple(value.shape) == shape if shaped else value.dim() <= 1 and value.numel() == numel)


class _StateColumn:
    """One key of every parameter's compressor state, read and written by parameter name."""

    def __init__(self, states: dict[str, dict[str, Tensor]], key: str) -> None:
        self.states = states
        self.key = key

    def get(self, name: str) -> Optional[Tensor]:
        return self.states.get(name, {}).get(self.key)

    def __setitem__(self, name: str, value: Tensor) -> None:
        self.states.setdefault(name, {})[self.key] = value
