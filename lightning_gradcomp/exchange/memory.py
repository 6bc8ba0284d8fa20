"""Per-worker memory of the compression: error-feedback residuals and compressor state.

Error feedback (Seide et al. 2014; Stich et al. 2018; Sahu et al. 2021, Alg. 1)::

    p_t     = g_t + e_t          (compensate)
    send      C(p_t)
    e_{t+1} = p_t - C(p_t)       (update)

so that ``C(p_t) + e_{t+1} == p_t``. For sparsifiers the invariant holds bit for bit: the residual is
``p_t`` with the sent coordinates set to exactly zero.

Residuals are kept in fp32 (fp64 for fp64 gradients) whatever the gradient's dtype
(:func:`~lightning_gradcomp.core.device.state_dtype`): with bf16 or fp16 parameters a small
gradient added to a larger residual would otherwise round away, and error feedback would stop
delivering it. ``p_t`` is formed in that dtype; only what the compressor sends is cast.

Everything is keyed by parameter *name*, never by DDP bucket index (DDP rebuilds its buckets after the
first step), and is part of the checkpoint. A residual is never poisoned by a non-finite gradient: on
a step where the worker's gradient of a parameter is not finite, that parameter's residual is left as
it was (see :mod:`lightning_gradcomp.exchange.pipeline` for what the exchange does on such a step).

Cost: ``p_t`` is written into a buffer kept from the previous step (on CPU, where a fresh allocation of
a large tensor costs page faults, about two extra passes over memory), and becomes the residual once
the exchange is done, while the previous residual becomes the next step's buffer. The previous residual
is left intact until then, so a step made void after the exchange (another worker's gradient was not
finite) keeps it exactly. On accelerators the caching allocator makes fresh tensors cheap, and no
buffer is kept (it would double the memory).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_gradcomp.core.device import state_dtype
from lightning_gradcomp.core.tensors import Finite, keep_if_finite


class CompressionMemory:
    """Residuals (error feedback) and per-parameter compressor state of one worker."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}
        self.states: dict[str, dict[str, Tensor]] = {}
        self._spares: dict[str, Tensor] = {}  # CPU only: next step's buffer for p (see the module docstring)

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
            self._keep_spare(name, corrected)
            return None
        subtract(corrected)
        previous = self.residuals.get(name)
        residual = keep_if_finite(corrected, previous, finite)
        self.residuals[name] = residual
        if residual is corrected and previous is not None:
            self._keep_spare(name, previous)
        return residual

    def _keep_spare(self, name: str, buffer: Tensor) -> None:
        if buffer.device.type == "cpu":
            self._spares[name] = buffer

    def state(self, name: str) -> dict[str, Tensor]:
        """The mutable compressor state of one parameter (created empty)."""
        return self.states.setdefault(name, {})

    def clear(self) -> None:
        self.residuals.clear()
        self.states.clear()
        self._spares.clear()

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
        self.residuals = {name: r.to(device) for name, r in state.get("residuals", {}).items()}
        self.states = {
            name: {k: v.to(device) for k, v in s.items()} for name, s in state.get("states", {}).items()
        }
