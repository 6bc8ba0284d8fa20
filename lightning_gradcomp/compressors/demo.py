"""DeMo: decoupled momentum, sent as its largest DCT coefficients.

Peng, Quesnelle & Kingma, "Decoupled Momentum Optimization" (arXiv 2411.19870; ICLR 2026), Algorithm 1
and the authors' ``demo.py``. Per worker and parameter, with momentum ``δ`` (fp32, kept by each worker),
learning rate ``η`` and weight decay ``λ``::

    1. p ← p·(1 − η·λ)                          decoupled weight decay          (the optimizer)
    2. δ ← β·δ + η·g                            momentum per worker, β = 0.999   (here)
    3. X = DCT(δ)                               orthonormal DCT-II per tile      (here)
    4. S = per tile, the k (32) entries of X of largest |X|                      (here)
    5. δ ← δ − IDCT(S)                          what is sent leaves the momentum (here)
    6. all-gather S; per coefficient, the mean over the workers that chose it; IDCT (here)
    7. p ← p − η·sign(aggregate)                                                 (the optimizer)

The compressor does steps 2-6 and hands ``ĝ = sign(IDCT(mean))`` to the optimizer as the gradient.
The learning rate and the weight decay live in the optimizer, which must be plain SGD (no momentum, no
moments: DeMo's momentum replaces them, :meth:`DeMo.check_optimizer` refuses the others):
``SGD(lr=η, weight_decay=λ)`` computes ``p ← p − η·(ĝ + λ·p) = p·(1 − η·λ) − η·ĝ``, steps 1 and 7 exactly.
Step 2 reads each parameter's ``η`` from the parameter group that holds it in the optimizers bound by
:meth:`DeMo.check_optimizer`, at every step (a scheduler changes it; a group's ``lr`` may be a 0-d tensor),
so the momentum weighs each gradient by its step's learning rate as the reference does. The strategies
bind with the parameters' names when they check the optimizers; a bare ``register()`` user calls
``gradcomp.bind(optimizer)`` before the first backward (the handle warns at the first exchange when none is
bound, and binds the first optimizer that steps the model, one step late). A parameter that no bound
optimizer holds takes ``η = 1`` with a warning, not an error: a model's optimizers are bound one at a time.
Unbound (as the outer compressor of local updates, whose outer gradients already carry the learning
rate), ``η = 1``.

Tiles (the reference's ``TransformDCT``): a weight of shape ``(R, C, ...)`` is viewed as ``(R, C·...)``
(the reference handles 2-D weights only; a convolution's trailing dimensions are flattened here) and cut
into ``a × b`` tiles, ``a`` the largest divisor of ``R`` at most ``chunk`` (64) and ``b`` that of the
columns; a 1-D tensor of ``n`` elements is one row of tiles of ``1 × b``. The transform of a tile ``T`` is
``D_a · T · D_bᵀ`` with the orthonormal DCT-II matrix ``D_n[i, j] = s_i · cos(π·(2j + 1)·i / (2n))``,
``s_0 = √(1/n)``, ``s_i = √(2/n)``.

The momentum of a compressed tensor is kept as its DCT coefficients: steps 2 to 5 become
``X ← β·X + η·DCT(g)``, the top-k of each tile of ``X``, ``X ← X − S``. The DCT is linear and orthonormal,
so this is the reference's ``δ`` exactly (up to rounding), with two transforms per step (``DCT(g)`` and
the aggregate's inverse) where the reference takes three (it also transforms ``S`` back). Each transform
is two matrix products over the whole tensor.

Wire: per tile, ``min(k, a·b)`` indices in ``⌈log₂(a·b)⌉`` bits (12 for a 64 × 64 tile), bit-packed, and the
values in the gradient's dtype or in ``value_dtype``. The momentum keeps what rounding to that dtype lost.
For a 64 × 64 tile with fp32 values that is 32·(12 + 32)/8 = 176 bytes for 16 KiB: 93x fewer bytes than
fp32; with bf16 values 146x.

On accelerators a whole bucket is compressed at once (:meth:`DeMo.exchange_segments`: a few dozen operations
per group of tensors of one tile shape, not per tensor), with the same values as per tensor up to rounding.
Tensors sent dense, and DeMo as the outer compressor of local updates: docs/compressors.md.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    CompressContext,
    Compressor,
    Payload,
    check_bool,
    check_int,
    squared_norm,
)
from lightning_gradcomp.compressors.bitpack import pack, pack_rows, packed_nbytes, unpack, unpack_rows
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.device import full_precision_matmuls, state_dtype, to_device
from lightning_gradcomp.core.protocol import Gather, Outcome, Round, SegmentsOutcome, SegmentsProtocol, stacked
from lightning_gradcomp.core.segments import Segments, SegmentsState, index_dtype
from lightning_gradcomp.core.tensors import row_scatter_sum_

#: the compressor state key of the decoupled momentum ``δ``: for a compressed tensor its DCT coefficients,
#: ``(tiles, a·b)`` in tile order (a checkpoint taken with another ``chunk`` starts the momentum afresh);
#: for a tensor sent dense ``δ`` itself
MOMENTUM = "momentum"

#: allowed ``value_dtype`` names
VALUE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

#: the attributes of a :class:`DeMo` that bind it to its optimizers (per process: not pickled)
_BINDING = ("_optimizer", "_named", "_unnamed", "_groups", "_groups_key", "_unheld")


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (the reference's ``_get_smaller_split``)."""
    for candidate in range(min(n, limit), 0, -1):
        if n % candidate == 0:
            return candidate
    return 1


@lru_cache(maxsize=64)
def dct_matrix(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The orthonormal DCT-II matrix ``D_n`` (its inverse is its transpose)."""
    i = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    matrix = torch.cos(math.pi * (2 * j + 1) * i / (2 * n)) * math.sqrt(2.0 / n)
    matrix[0] /= math.sqrt(2.0)
    return to_device(matrix.to(dtype), device)  # built once per device, copied without a host sync


@dataclass(frozen=True)
class Tiling:
    """How a tensor of ``rows × cols`` elements is cut into ``a × b`` tiles, and how many coefficients
    of each tile are sent."""

    rows: int
    cols: int
    a: int
    b: int
    k: int

    @classmethod
    def of(cls, numel: int, shape: Sequence[int], chunk: int, k: int) -> "Tiling":
        """The tiling of a tensor of ``shape`` (flat ``numel`` elements; a shape that does not match is
        taken as 1-D)."""
        if len(shape) >= 2 and math.prod(shape) == numel:
            rows, cols = shape[0], numel // shape[0]
        else:
            rows, cols = 1, numel
        a, b = largest_divisor_at_most(rows, chunk), largest_divisor_at_most(cols, chunk)
        return cls(rows, cols, a, b, min(k, a * b))

    @property
    def tile(self) -> int:
        return self.a * self.b

    @property
    def tiles(self) -> int:
        return (self.rows // self.a) * (self.cols // self.b)

    @property
    def count(self) -> int:
        return self.tiles * self.k

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.tile)))

    def encode(self, flat: Tensor) -> Tensor:
        """DCT of every tile: ``(tiles, a·b)`` coefficients of the flat tensor (two matrix products over the
        whole tensor, then one copy into tile order)."""
        grid_rows, grid_cols = self.rows // self.a, self.cols // self.b
        out = flat.view(-1, self.b)
        with full_precision_matmuls():
            if self.b > 1:  # along each tile's rows: X·D_bᵀ
                out = out @ dct_matrix(self.b, flat.dtype, flat.device).T
            if self.a > 1:  # along each tile's columns: D_a·X
                out = torch.matmul(dct_matrix(self.a, flat.dtype, flat.device), out.view(grid_rows, self.a, -1))
        return out.reshape(grid_rows, self.a, grid_cols, self.b).transpose(1, 2).reshape(self.tiles, self.tile)

    @property
    def span(self) -> int:
        """The most consecutive elements of the flat tensor that tile order keeps together: a row of a tile
        (``b``), or the whole tensor where tile order is the tensor's own (tiles one row high, or as wide
        as the tensor)."""
        return self.rows * self.cols if self.a == 1 or self.b == self.cols else self.b

    def tile_runs(self, run: int) -> Tensor:
        """The flat tensor cut into runs of ``run`` consecutive elements (``run`` divides :attr:`span`): where
        each run lies, in units of ``run``, in tile order (``encode``'s order): ``(rows·cols / run,)`` int64.
        With ``run = 1``, the flat position of every element in tile order."""
        runs = torch.arange(self.rows * self.cols // run)
        if self.span != self.b:  # tile order is the tensor's own
            return runs
        grid = runs.view(self.rows // self.a, self.a, self.cols // self.b, self.b // run)
        return grid.transpose(1, 2).reshape(-1)

    def decode(self, coefficients: Tensor) -> Tensor:
        """Inverse of :meth:`encode` (``D_aᵀ·C·D_b`` per tile): the flat tensor."""
        grid_rows, grid_cols = self.rows // self.a, self.cols // self.b
        out = coefficients.reshape(grid_rows, grid_cols, self.a, self.b).transpose(1, 2).reshape(
            grid_rows, self.a, grid_cols * self.b)
        with full_precision_matmuls():
            if self.a > 1:
                out = torch.matmul(dct_matrix(self.a, out.dtype, out.device).T, out)
            out = out.reshape(-1, self.b)
            if self.b > 1:
                out = out @ dct_matrix(self.b, out.dtype, out.device)
        return out.reshape(-1)


def transform_tiles(tiles: Tensor) -> Tensor:
    """DCT of a batch of ``(n, a, b)`` tiles, ``D_a·T·D_bᵀ`` (rows first, as :meth:`Tiling.encode`)."""
    a, b = tiles.shape[1:]
    with full_precision_matmuls():
        if b > 1:
            tiles = tiles @ dct_matrix(b, tiles.dtype, tiles.device).T
        if a > 1:
            tiles = torch.matmul(dct_matrix(a, tiles.dtype, tiles.device), tiles)
    return tiles


def inverse_tiles(coefficients: Tensor) -> Tensor:
    """Inverse of :func:`transform_tiles`, ``D_aᵀ·C·D_b`` (columns first, as :meth:`Tiling.decode`)."""
    a, b = coefficients.shape[1:]
    with full_precision_matmuls():
        if a > 1:
            coefficients = torch.matmul(dct_matrix(a, coefficients.dtype, coefficients.device).T, coefficients)
        if b > 1:
            coefficients = coefficients @ dct_matrix(b, coefficients.dtype, coefficients.device)
    return coefficients


class DeMo(Compressor):
    """DeMo: each worker's momentum, sent as its ``k`` largest DCT coefficients per tile; the optimizer
    steps along the sign of their aggregate (see the module docstring for the seven steps).

    Use it with ``torch.optim.SGD(lr, weight_decay)`` and no momentum, and without gradient clipping: the
    sign already bounds each coordinate's step to ``±lr``, and clipping the ±1s by norm (about ``√d``)
    would shrink every step by that factor (the Trainer strategies refuse ``gradient_clip_val``).

    Args:
        chunk: the tile edge to aim for (64): tiles are the largest divisors of each dimension at most this.
        k: coefficients sent per tile (32).
        decay: ``β``, the momentum's decay in ``[0, 1)`` (0.999).
        sign: hand the optimizer the sign of the aggregate (True, DeMo's) or the aggregate itself.
        value_dtype: the dtype of the values on the wire: ``None`` (the gradient's), ``"float16"`` or
            ``"bfloat16"``.
    """

    name = "demo"
    #: the optional capabilities it provides (:data:`~lightning_gradcomp.compressors.base.CAPABILITIES`)
    capabilities = frozenset({"whole_bucket", "dense_segments", "finalize_dense"})
    owns_residual = True  # the momentum δ keeps what was not sent

    def __init__(self, chunk: int = 64, k: int = 32, decay: float = 0.999, sign: bool = True,
                 value_dtype: Optional[str] = None) -> None:
        self.chunk = check_int(chunk, "chunk", 1)
        self.k = check_int(k, "k", 1)
        self.decay = check_number(decay, "decay", "a number in [0, 1)", lambda value: 0.0 <= value < 1.0)
        self.sign = check_bool(sign, "sign")
        if value_dtype is not None and value_dtype not in VALUE_DTYPES:
            raise ValueError(f"`value_dtype` must be None or one of {', '.join(map(repr, VALUE_DTYPES))}, "
                             f"got {value_dtype!r}")
        self.value_dtype = value_dtype
        self._unbind()
        self._warned: set[str] = set()  # parameters whose tiles are too small to compress (warned once)

    @property
    def averages_over_senders(self) -> bool:
        return True  # step 6: per coefficient, the mean over the workers that chose it

    def hparams(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "k": self.k, "decay": self.decay, "sign": self.sign,
                "value_dtype": self.value_dtype}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in _BINDING:  # the binding is per process: the strategy binds again
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unbind()

    def _unbind(self) -> None:
        """No optimizer bound: ``η = 1``."""
        #: the optimizer bound last (:attr:`awaits_optimizer`)
        self._optimizer: Optional[weakref.ReferenceType] = None
        #: the optimizers bound with the model's parameter names, in the order bound: ``(optimizer, names)``
        self._named: list[tuple[weakref.ReferenceType, Mapping[int, str]]] = []
        #: the optimizer bound last without names: every parameter takes its first group's ``η``
        self._unnamed: Optional[weakref.ReferenceType] = None
        #: parameter name -> (optimizer, index of its group), built from :attr:`_named` (see :meth:`_holders`)
        self._groups: dict[str, tuple[weakref.ReferenceType, int]] = {}
        self._groups_key: Optional[tuple] = None
        #: parameters that no optimizer bound with names holds (warned once)
        self._unheld: set[str] = set()

    # ------------------------------------------------------------------ the optimizer
    def check_optimizer(self, optimizer: Any, names: Optional[Mapping[int, str]] = None) -> None:
        """Refuse an optimizer other than plain SGD (DeMo's momentum replaces any momentum or moments, and
        step 7 is SGD's step), then bind it: step 2 reads each parameter's learning rate from the group of
        ``optimizer`` that holds it, at every step.

        Args:
            optimizer: the optimizer that steps DeMo's result.
            names: ``{id(parameter): name}``, the names the exchange gives the model's parameters (its
                ``named_parameters()``): how a tensor's name finds its parameter group. Several optimizers
                may be bound so (each holding some of the parameters; one bound again replaces itself).
                ``None``: every parameter takes the first group's learning rate (warned when there are
                several groups).
        """
        allowed = "allowed: torch.optim.SGD with momentum=0 (weight_decay gives DeMo's decoupled weight decay)"
        for index, group in enumerate(optimizer.param_groups):
            if "betas" in group:
                raise ValueError(
                    f"DeMo holds the momentum and steps along a sign, but {type(optimizer).__name__} keeps moments "
                    f"(betas={tuple(group['betas'])}, param group {index}); {allowed}")
            if group.get("momentum", 0):
                raise ValueError(
                    f"DeMo holds the momentum, but {type(optimizer).__name__} applies momentum={group['momentum']} "
                    f"too (param group {index}); {allowed}")
            if group.get("maximize", False):
                raise ValueError(f"DeMo steps against its aggregate, but param group {index} has maximize=True; "
                                 f"{allowed}")
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"DeMo's step is SGD's along the sign of the aggregate, but the optimizer is "
                             f"{type(optimizer).__name__}; {allowed}")
        if names is not None and not isinstance(names, Mapping):
            raise ValueError(f"`names` must be a mapping of id(parameter) -> parameter name, e.g. "
                             f"{{id(p): n for n, p in model.named_parameters()}}, got {type(names).__name__}")
        reference = weakref.ref(optimizer)
        self._optimizer = reference
        if names is None:
            self._unnamed = reference
            if len(optimizer.param_groups) > 1:
                warnings.warn(
                    f"DeMo: {type(optimizer).__name__} has {len(optimizer.param_groups)} parameter groups, but no "
                    "parameter names came with it (check_optimizer(optimizer, names={id(p): name for name, p in "
                    "model.named_parameters()})): step 2 takes the first group's learning rate for every "
                    "parameter. gradcomp.bind(optimizer) and the strategies pass the names", UserWarning,
                    stacklevel=2)
            return
        self._named = [(bound, known) for bound, known in self._named if bound() not in (None, optimizer)]
        self._named.append((reference, names))
        if self._unnamed is not None and self._unnamed() is optimizer:
            self._unnamed = None
        self._groups_key = None  # built again at the next look-up

    @property
    def produces_signs(self) -> bool:
        """With ``sign=True`` the optimizer steps along signs (±1 per coordinate): gradient clipping by
        norm would shrink every step by about ``√d``."""
        return self.sign

    @property
    def awaits_optimizer(self) -> bool:
        """Step 2 reads the learning rate of the optimizer :meth:`check_optimizer` bound; none is bound
        (or it was deleted): ``η = 1``."""
        return self._optimizer is None or self._optimizer() is None

    def _holders(self) -> dict[str, tuple[weakref.ReferenceType, int]]:
        """Parameter name -> (optimizer, index of the group that holds it), over the optimizers bound with
        names (a later one wins a parameter two hold). Kept, and built again when an optimizer is gone or its
        number of groups changed (``add_param_group``); the look-up reads only Python objects."""
        optimizers = [bound() for bound, _ in self._named]
        key = tuple((id(optimizer), len(optimizer.param_groups)) if optimizer is not None else None
                    for optimizer in optimizers)
        if key != self._groups_key:
            self._named = [entry for entry, optimizer in zip(self._named, optimizers) if optimizer is not None]
            groups: dict[str, tuple[weakref.ReferenceType, int]] = {}
            for bound, names in self._named:
                optimizer = bound()
                for index, group in enumerate(optimizer.param_groups):
                    for parameter in group["params"]:
                        name = names.get(id(parameter))
                        if name is not None:
                            groups[name] = (bound, index)
            self._groups = groups
            self._groups_key = tuple(item for item in key if item is not None)
        return self._groups

    def _learning_rate(self, name: Optional[str] = None) -> Any:
        """``η`` of step 2 for parameter ``name``: the learning rate of the group that holds it in an
        optimizer bound with names; else the first group's of an optimizer bound without names; else 1
        (unbound, or a parameter that no bound optimizer holds: warned once). A Python number, or a 0-d
        tensor where the group keeps one (never read on the host). Without ``name``: the first group's of
        the optimizer bound last (1 when unbound)."""
        if name is None:
            optimizer = self._optimizer() if self._optimizer is not None else None
            return 1.0 if optimizer is None else optimizer.param_groups[0]["lr"]
        if self._named:
            held = self._holders().get(name)
            if held is not None:
                optimizer = held[0]()
                if optimizer is not None:
                    return optimizer.param_groups[held[1]]["lr"]
        unnamed = self._unnamed() if self._unnamed is not None else None
        if unnamed is not None:
            return unnamed.param_groups[0]["lr"]
        if self._named and name not in self._unheld:
            self._unheld.add(name)
            warnings.warn(
                f"DeMo: parameter {name!r} is in no parameter group of the optimizers bound "
                f"({', '.join(sorted({type(bound()).__name__ for bound, _ in self._named if bound() is not None}))}): "
                "step 2 takes lr=1 for it, as unbound. Add it to the optimizer that steps it (or bind that one: "
                "gradcomp.bind(optimizer)), or set requires_grad=False if nothing should train it",
                UserWarning, stacklevel=3)
        return 1.0

    def _momentum(self, update: Tensor, ctx: CompressContext) -> Tensor:
        """``δ ← β·δ + η·update`` (a new tensor; ``update`` and the state in the same domain and shape)."""
        lr = self._learning_rate(ctx.name)
        scaled = update * lr if isinstance(lr, Tensor) or lr != 1.0 else update
        previous = ctx.state.get(MOMENTUM)
        if previous is None or previous.shape != update.shape:
            return scaled.clone() if scaled is update else scaled
        return torch.add(scaled, previous, alpha=self.decay)

    # ------------------------------------------------------------------ the wire format
    def tiling(self, numel: int, shape: Sequence[int]) -> Tiling:
        return Tiling.of(numel, shape, self.chunk, self.k)

    def static_count(self, numel: int) -> Optional[int]:
        """The count of a 1-D tensor of ``numel`` elements (a weight's depends on its shape, see
        :meth:`wire_format`); never on the data."""
        return self.tiling(numel, ()).count

    def _value_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return VALUE_DTYPES[self.value_dtype] if self.value_dtype is not None else dtype

    def wire_format(self, shape: Sequence[int], dtype: torch.dtype, count: Optional[int] = None,
                    world_size: int = 1) -> list[list[tuple[torch.dtype, int]]]:
        tiling = self.tiling(math.prod(shape), shape)
        return [[(torch.uint8, packed_nbytes(tiling.count, tiling.index_bits)),
                 (self._value_dtype(dtype), tiling.count)]]

    def check_payload(self, payload: Payload, dtype: torch.dtype, name: str = "") -> None:
        tiling: Tiling = payload.meta
        declared = self.wire_format((tiling.rows, tiling.cols), dtype)[0]
        actual = [(part.dtype, part.numel()) for part in payload.parts]
        if payload.count != tiling.count or declared != actual:
            where = f" for parameter {name!r}" if name else ""
            raise ValueError(f"{type(self).__name__}.compress returned {payload.count} coordinates in parts "
                             f"{actual}{where}, but its tiling declares {tiling.count} in {declared}")

    # ------------------------------------------------------------------ compress and decode
    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        """Steps 2 to 5 on the DCT coefficients of the momentum: ``DCT(δ) ← β·DCT(δ) + η·DCT(g)``, the
        top-k of each tile, and what is sent leaves them (the DCT is linear and orthonormal, so this is
        the reference's ``δ ← δ − IDCT(S)`` without transforming ``S`` back)."""
        tiling = self.tiling(tensor.numel(), ctx.shape)
        self._warn_whole_tiles(tiling, ctx)
        momentum = self._momentum(tiling.encode(tensor.to(state_dtype(tensor.dtype))), ctx)
        chosen, values = self._select(momentum, tiling.k, self._value_dtype(ctx.wire_dtype(tensor)))
        ctx.commit(MOMENTUM, momentum)
        return Payload((pack(chosen.reshape(-1), tiling.index_bits), values.reshape(-1)), tensor.numel(),
                       tiling.count, tiling)

    def _select(self, momentum: Tensor, k: int, wire: torch.dtype) -> tuple[Tensor, Tensor]:
        """Steps 4 and 5 on ``(tiles, a·b)`` coefficients: per tile the ``k`` of largest magnitude (``topk``
        ranks NaN highest, so a non-finite gradient, voided by the bucket's verdict, still gives valid
        indices) and their values in the wire's dtype; what was sent leaves the momentum, in place (all of
        it, or what rounding to a 16-bit dtype lost). Returns ``(indices, values)``."""
        chosen = momentum.abs().topk(k, dim=1, sorted=False).indices
        selected = momentum.gather(1, chosen)
        if wire == momentum.dtype:  # sent exactly
            momentum.scatter_(1, chosen, 0.0)
            return chosen, selected
        if torch.finfo(wire).max < torch.finfo(selected.dtype).max:  # fp16: clamped (the excess stays, not inf)
            values = selected.clamp(-torch.finfo(wire).max, torch.finfo(wire).max).to(wire)
        else:
            values = selected.to(wire, copy=True)
        momentum.scatter_(1, chosen, selected.sub_(values.to(momentum.dtype)))
        return chosen, values

    def _warn_whole_tiles(self, tiling: Tiling, ctx: CompressContext) -> None:
        """Warn once per parameter whose tiles are sent whole (e.g. a prime dimension: 1-wide tiles)."""
        if tiling.k == tiling.tile and ctx.name not in self._warned:
            self._warned.add(ctx.name)
            warnings.warn(f"DeMo: parameter {ctx.name!r} of shape {tuple(ctx.shape)} is cut into tiles of "
                          f"{tiling.a} x {tiling.b} (the largest divisors of its dimensions up to chunk={self.chunk}), "
                          f"and k={self.k} sends every coefficient with its index: more bytes than sending it dense; "
                          "pad the dimension, lower k, or raise min_compress_numel above its size",
                          RuntimeWarning, stacklevel=3)

    def _coefficients(self, payload: Payload) -> tuple[Tensor, Tensor]:
        """``(indices within each tile, values)``, both ``(tiles, k)``."""
        tiling: Tiling = payload.meta
        within = unpack(payload.parts[0], tiling.index_bits, tiling.count).view(tiling.tiles, tiling.k)
        return within, payload.parts[1].view(tiling.tiles, tiling.k)

    def compression_error(self, tensor: Tensor, outcome: Outcome, ctx: CompressContext) -> tuple[Tensor, Tensor]:
        """``(‖X_{t+1}‖², ‖X_{t+1}‖² + ‖S‖²)``: the momentum's coefficients left behind are DeMo's compression
        error, and with the sent ones they are what was compressed (the DCT is orthonormal, so these are
        also the norms of ``δ``)."""
        sent = squared_norm(outcome.payload.parts[1].float())
        momentum = ctx.state.get(MOMENTUM)
        error = squared_norm(momentum) if momentum is not None else torch.zeros_like(sent)
        return error, error + sent

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        tiling: Tiling = payload.meta
        within, values = self._coefficients(payload)
        coefficients = torch.zeros(tiling.tiles, tiling.tile, dtype=out.dtype, device=out.device)
        coefficients.scatter_(1, within, values.to(out.dtype))
        out.add_(tiling.decode(coefficients), alpha=alpha)

    def exchange(self, tensor: Tensor, ctx: CompressContext):
        """One gather of every worker's coefficients; per coefficient the mean over the workers that chose
        it, transformed back, and its sign (step 6)."""
        payload = self.compress(tensor, ctx)
        self.check_payload(payload, ctx.wire_dtype(tensor), ctx.name)
        (rows,) = yield Round([Gather(payload.parts)], last=True)
        tiling: Tiling = payload.meta
        received = [Payload(row.parts, payload.numel, payload.count, tiling) for row in rows]

        def write(out: Tensor) -> None:
            dtype = state_dtype(out.dtype)
            sums = torch.zeros(tiling.tiles, tiling.tile, dtype=dtype, device=out.device)
            chosen = torch.zeros_like(sums)
            for item in received:
                within, values = self._coefficients(item)
                sums.scatter_add_(1, within, values.to(dtype))
                chosen.scatter_add_(1, within, torch.ones_like(values, dtype=dtype))
            result = tiling.decode(sums.div_(chosen.clamp_min_(1.0)))
            out.copy_(result.sign_() if self.sign else result)

        return Outcome(payload.count, lambda residual: self.accumulate(payload, residual, alpha=-1.0), write, payload)

    # ------------------------------------------------------------------ tensors sent dense
    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """Every coefficient is sent: the whole momentum is averaged, and the momentum is emptied."""
        momentum = self._momentum(tensor.to(state_dtype(tensor.dtype)), ctx)
        sent = momentum.to(tensor.dtype, copy=True)
        ctx.commit(MOMENTUM, momentum.sub_(sent))  # zero, or what rounding to a 16-bit dtype lost
        return sent

    def finalize_dense(self, out: Tensor, ctx: CompressContext) -> None:
        """The sign of the averaged momentum (step 7's input)."""
        if self.sign:
            out.sign_()

    def finalize_dense_many(self, outs: Sequence[Tensor], contexts: Sequence[CompressContext]) -> None:
        """:meth:`finalize_dense` of a bucket's tensors sent dense: one multi-tensor sign."""
        if self.sign:
            torch._foreach_sign_(list(outs))

    # ------------------------------------------------------------------ a whole bucket at once
    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        return True  # any sizes: the plan of groups handles each tensor's shape

    def dense_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                       state: SegmentsState) -> Optional[Tensor]:
        """:meth:`dense` of every tensor sent dense, at once: ``δ ← β·δ + η·g`` on the flat state, all of
        it sent (``η`` per tensor: one scale per element where the tensors' groups differ)."""
        rates: _RowScales = segments.constant(("demo", "dense learning rates"), flat.device, lambda device: _RowScales(
            [segments.rows_of(index) for index in range(len(segments))]))
        lr = rates.scale([self._learning_rate(name) for name in segments.names], flat.dtype, flat.device)
        if isinstance(lr, Tensor) and lr.dim():  # (rows, 1)
            scaled = (flat.view(-1, segments.align) * lr).view(-1)
        else:
            scaled = flat * lr if isinstance(lr, Tensor) or lr != 1.0 else flat
        previous = state.get(MOMENTUM)
        momentum = scaled.clone() if previous is None else torch.add(scaled, previous, alpha=self.decay)
        dtype = contexts[0].dtype or flat.dtype
        if dtype == momentum.dtype:  # all of it sent exactly: the momentum is emptied
            state.commit(MOMENTUM, torch.zeros_like(momentum))
            return momentum
        sent = momentum.to(dtype)
        state.commit(MOMENTUM, momentum.sub_(sent))  # what rounding to a 16-bit dtype lost
        return sent

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """Steps 2 to 6 for every tensor of a bucket, one group of tensors with the same tile shape at a
        time (:class:`_TileGroups`): each group's tiles gathered in tile order by one index (of bands of
        tiles, or of runs of elements), transformed by two batched products, the momentum updated and
        selected on the group's flat state, the indices packed, and on the way back the workers'
        coefficients scattered and averaged by two scatter-adds, transformed back and put in place by the
        same index."""
        plan: _TileGroups = segments.constant(("demo", self.chunk, self.k), flat.device,
                                              lambda device: _TileGroups(self, segments, device))
        for tiling, ctx in zip(plan.tilings, contexts):
            self._warn_whole_tiles(tiling, ctx)
        lrs = [self._learning_rate(name) for name in segments.names]
        wire = self._value_dtype(contexts[0].wire_dtype(flat))
        previous = state.get(MOMENTUM, plan.layout)
        if previous is not None:
            previous = plan.to_group_order(previous)
        momentum = torch.empty(plan.layout.total, dtype=flat.dtype, device=flat.device)  # in group order
        parts: list[Tensor] = []
        selections: list[tuple[Tensor, Tensor]] = []
        for group, members, rates in zip(plan.groups, plan.members, plan.rates):
            tiles = transform_tiles(group.read(flat))
            coefficients = tiles.view(group.tiles, group.tile)
            # η per tile: a number where the group's tensors share it, else a (tiles, 1) column
            lr = rates.scale([lrs[index] for index in members], coefficients.dtype, coefficients.device)
            scaled = coefficients * lr if isinstance(lr, Tensor) or lr != 1.0 else coefficients
            current = momentum[group.start:group.stop].view(group.tiles, group.tile)
            if previous is None:
                current.copy_(scaled)
            else:
                torch.add(scaled, previous[group.start:group.stop].view(group.tiles, group.tile), alpha=self.decay,
                          out=current)
            chosen, values = self._select(current, group.k, wire)
            parts += [pack_rows(chosen.view(-1), group.bits), values.view(-1)]
            selections.append((chosen, values))
        state.commit(MOMENTUM, plan.to_layout_order(momentum), plan.layout)
        (gathered,) = yield Round([Gather(tuple(parts))], last=True)

        def write(out: Tensor) -> None:  # out: zero-filled (SegmentsOutcome.write), so adding puts in place
            dtype = state_dtype(out.dtype)  # means and their inverse transform in fp32, as per tensor
            for number, group in enumerate(plan.groups):
                workers = len(gathered)
                within = unpack_rows(stacked(gathered, 2 * number), group.bits, group.count)
                values = stacked(gathered, 2 * number + 1)
                # (workers, tiles, k) -> (tiles, workers·k): one scatter-add per group, workers in order
                within = within.reshape(workers, group.tiles, group.k).transpose(0, 1).reshape(group.tiles, -1)
                values = values.view(workers, group.tiles, group.k).transpose(0, 1).reshape(group.tiles, -1)
                values = values.to(dtype)
                sums, chosen = torch.zeros(2, group.tiles, group.tile, dtype=dtype, device=out.device).unbind()
                row_scatter_sum_(sums, within, values)  # the same sums on every rank (counts are exact)
                chosen.scatter_add_(1, within, torch.ones_like(values))
                mean = sums.div_(chosen.clamp_min_(1.0)).view(group.tiles, group.a, group.b)
                group.add_to(out, inverse_tiles(mean).to(out.dtype))
            if self.sign:
                out.sign_()

        def subtract(residual: Tensor) -> None:  # δ -= IDCT(S): what was sent on this worker's behalf
            for group, (chosen, values) in zip(plan.groups, selections):
                sent = torch.zeros(group.tiles, group.tile, dtype=residual.dtype, device=residual.device)
                sent.scatter_(1, chosen, values.to(residual.dtype))
                group.add_to(residual, inverse_tiles(sent.view(group.tiles, group.a, group.b)), alpha=-1.0)

        def error() -> tuple[Tensor, Tensor]:  # as compression_error: (‖X_{t+1}‖², ‖X_{t+1}‖² + ‖S‖²)
            kept = state.get(MOMENTUM, plan.layout)
            carried = torch.stack(torch._foreach_norm(plan.layout.views(kept))).double().square()
            sent_sq = torch.cat([torch.segment_reduce(values.double().square().view(-1), "sum",
                                                      lengths=group.counts, unsafe=True)
                                 for group, (_, values) in zip(plan.groups, selections)])
            if plan.member_order is not None:
                sent_sq = sent_sq.index_select(0, plan.member_order)
            return carried, carried + sent_sq

        # scatter-adds; the sign then (torch.sign(NaN) is 0) would lose a NaN filled in
        return SegmentsOutcome([tiling.count for tiling in plan.tilings], subtract, write, error, adds=not self.sign)


@dataclass(frozen=True)
class _Pieces:
    """Pieces of a flat buffer of one shape, one every ``step`` elements from ``offset`` on: the rows of a
    view of the buffer (:meth:`of`). A group's tiles are whole pieces, so that one index of pieces reads
    them (``index_select``) and writes them back (``index_add_``) in place of an index per element.

    The pieces never overlap (``step`` is at least a piece's extent), so that the view can be written."""

    offset: int
    step: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def of(self, flat: Tensor) -> Tensor:
        """``flat`` as a ``(pieces, *shape)`` view (the pieces that fit in it)."""
        extent = 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.strides))
        count = (flat.numel() - self.offset - extent) // self.step + 1
        return flat[self.offset:].as_strided((count, *self.shape), (self.step, *self.strides))


@dataclass
class _TileGroup:
    """The tensors of a bucket with one tile shape: their tiles in one batch.

    The tiles are read from the bucket's flat buffer, and written back, as whole :class:`_Pieces` picked by
    :attr:`index` (int32 below 2^31 pieces) in tile order: the group's only constant that grows with the
    bucket. Where the members have as many columns and their starts lie a whole number of bands apart (a
    band: ``a`` rows of a tensor, a row of tiles), a piece is a band seen as its tiles, ``(cols / b, a, b)``:
    one index per band. Otherwise a piece is a run of consecutive elements, as long as every member's start
    and :attr:`Tiling.span` allow (a tile's row, or more where tile order is the tensors' own): ``4 / run``
    bytes per element."""

    a: int
    b: int
    k: int
    bits: int
    tiles: int
    start: int  # where the group's momentum lies in the bucket's momentum, in group order
    pieces: _Pieces
    index: Tensor  # the piece of every band or run of the group's tiles, in tile order
    counts: Tensor  # coefficients sent per member tensor (for telemetry)

    @property
    def tile(self) -> int:
        return self.a * self.b

    @property
    def stop(self) -> int:
        return self.start + self.tiles * self.tile

    @property
    def count(self) -> int:
        return self.tiles * self.k

    def read(self, flat: Tensor) -> Tensor:
        """The group's tiles in ``flat`` (laid out as the bucket), ``(tiles, a, b)`` in tile order: one gather."""
        return self.pieces.of(flat).index_select(0, self.index).view(self.tiles, self.a, self.b)

    def add_to(self, flat: Tensor, tiles: Tensor, alpha: float = 1.0) -> None:
        """``flat += alpha·tiles`` at the tiles' places (the inverse of :meth:`read`): one scatter-add."""
        self.pieces.of(flat).index_add_(0, self.index, tiles.reshape(-1, *self.pieces.shape), alpha=alpha)


def _tile_pieces(tilings: Sequence[Tiling], starts: Sequence[int], total: int) -> tuple[_Pieces, Tensor]:
    """The :class:`_Pieces` of tensors of one tile shape (``tilings``, at ``starts`` in a flat buffer of
    ``total`` elements) and the index of their tiles' pieces in tile order (see :class:`_TileGroup`)."""
    first = tilings[0]
    band = first.a * first.cols
    if all(tiling.cols == first.cols for tiling in tilings) and len({start % band for start in starts}) == 1:
        pieces = _Pieces(starts[0] % band, band, (first.cols // first.b, first.a, first.b),
                         (first.b, first.cols, 1))
        index = torch.cat([torch.arange(tiling.rows // tiling.a) + (start - pieces.offset) // band
                           for tiling, start in zip(tilings, starts)])
    else:
        run = math.gcd(*(tiling.span for tiling in tilings), *starts)
        pieces = _Pieces(0, run, (run,), (1,))
        index = torch.cat([tiling.tile_runs(run) + start // run for tiling, start in zip(tilings, starts)])
    return pieces, index.to(index_dtype(total // pieces.step))  # index_select: either


class _TileGroups:
    """Constants of DeMo's bucket-wise exchange for one layout: each tensor's :class:`Tiling`, the tensors
    grouped by tile shape (in order of first appearance), and the momentum's layout (``(tiles, a·b)`` per
    tensor, in the bucket's order; the groups' momentum lies in group order, one ``cat`` away from it where
    the two differ)."""

    def __init__(self, demo: DeMo, segments: Segments, device: torch.device) -> None:
        self.tilings = [demo.tiling(numel, shape) for numel, shape in zip(segments.numels, segments.shapes)]
        self.layout = Segments(segments.names, tuple((tiling.tiles, tiling.tile) for tiling in self.tilings), 1)
        members: dict[tuple[int, int], list[int]] = {}
        for index, tiling in enumerate(self.tilings):
            members.setdefault((tiling.a, tiling.b), []).append(index)
        order = [index for indices in members.values() for index in indices]
        self.groups: list[_TileGroup] = []
        #: each group's members (indices in the bucket), and their learning rates per tile (step 2)
        self.members: list[tuple[int, ...]] = [tuple(indices) for indices in members.values()]
        self.rates = [_RowScales([self.tilings[index].tiles for index in indices]) for indices in self.members]
        start = 0
        for (a, b), indices in members.items():
            tilings = [self.tilings[index] for index in indices]
            pieces, picks = _tile_pieces(tilings, [segments.starts[index] for index in indices], segments.total)
            tiles = sum(tiling.tiles for tiling in tilings)
            counts = torch.tensor([tiling.count for tiling in tilings])
            self.groups.append(_TileGroup(a, b, tilings[0].k, tilings[0].index_bits, tiles, start, pieces,
                                          to_device(picks, device), to_device(counts, device)))
            start += tiles * a * b
        #: the members in group order, ``None`` where that is the bucket's order
        self.order: Optional[list[int]] = None if order == sorted(order) else order
        self.member_order: Optional[Tensor] = None if self.order is None else to_device(
            torch.tensor([order.index(index) for index in range(len(order))]), device)
        self._group_starts: list[int] = [0] * len(order)  # each member's momentum in group order
        offset = 0
        for index in order:
            self._group_starts[index] = offset
            offset += self.layout.numels[index]

    def to_group_order(self, momentum: Tensor) -> Tensor:
        """The momentum laid out by :attr:`layout`, in group order (one ``cat``; itself where they agree)."""
        if self.order is None:
            return momentum
        views = self.layout.views(momentum)
        return torch.cat([views[index] for index in self.order])

    def to_layout_order(self, momentum: Tensor) -> Tensor:
        """The inverse of :meth:`to_group_order`."""
        if self.order is None:
            return momentum
        return torch.cat([momentum[start:start + numel] for start, numel in zip(self._group_starts,
                                                                                   self.layout.numels)])


def _rate_key(lr: Any) -> Any:
    """What tells two learning rates apart on the host: a number's value, a tensor's identity (its value is
    never read: a 0-d tensor ``lr`` may live on the device and change in place)."""
    return ("tensor", id(lr)) if isinstance(lr, Tensor) else float(lr)


def _device_scalar(lr: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``lr`` (a number or a 0-d tensor) as a 0-d tensor of ``dtype`` on ``device``, without a host sync."""
    if isinstance(lr, Tensor):
        lr = lr.detach().reshape(())
        if lr.device.type == "cpu" and device.type != "cpu":
            return to_device(lr.to(dtype), device)
        return lr.to(device=device, dtype=dtype)
    return torch.full((), lr, dtype=dtype, device=device)  # a fill on the device, no copy


class _RowScales:
    """Step 2's ``η`` for rows of several tensors (members) laid end to end, ``rows[m]`` rows each: the
    learning rate itself where the members share one (a number or the group's 0-d tensor: the arithmetic
    of a single ``η``), else a ``(Σ rows, 1)`` column of each row's member's.

    A column of numbers is kept and made again only when they change (one copy to the device then, none
    at the other steps); one with 0-d tensors among them (capturable optimizers, whose ``lr`` a scheduler
    changes in place) is gathered on the device at every step by a kept index. Never a host read."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = torch.tensor(list(rows), dtype=torch.int64)
        self._column: tuple[Any, Optional[Tensor]] = (None, None)  # (key, column of numbers)
        self._index: tuple[Any, Optional[Tensor]] = (None, None)  # (key, row -> distinct rate)

    def scale(self, lrs: Sequence[Any], dtype: torch.dtype, device: torch.device) -> Union[float, Tensor]:
        keys = [_rate_key(lr) for lr in lrs]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) == 1:
            return lrs[0]
        if not any(isinstance(lr, Tensor) for lr in lrs):
            key = (tuple(keys), dtype, str(device))
            if self._column[0] != key:
                column = torch.tensor(keys, dtype=dtype).repeat_interleave(self.rows).view(-1, 1)
                self._column = (key, to_device(column, device))
            return self._column[1]
        slots = [distinct.index(key) for key in keys]
        index_key = (tuple(slots), str(device))
        if self._index[0] != index_key:
            self._index = (index_key, to_device(torch.tensor(slots).repeat_interleave(self.rows), device))
        values = torch.stack([_device_scalar(lrs[keys.index(key)], dtype, device) for key in distinct])
        return values.index_select(0, self._index[1]).view(-1, 1)
