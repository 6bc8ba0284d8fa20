r"""PowerSGD: low-rank gradient compression by one step of power iteration (Vogels, Karimireddy & Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, Alg. 1).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor, check_bool, check_int
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.device import full_precision_matmuls, shared_draw_generator_device, to_device
from lightning_gradcomp.core.protocol import Mean, Outcome, Protocol, Round, SegmentsOutcome, SegmentsProtocol
from lightning_gradcomp.core.segments import Segments, SegmentsState

Q_STATE = "q"

#: elements of the zero-padded batch of every shape's ``P`` below which padding is always worth one batch,
#: and above it the most padded elements per real one
PAD_LIMIT = 1 << 22
PAD_RATIO = 4


class PowerSGD(Compressor):
    r"""Rank-``r`` PowerSGD with error feedback and warm start.

    Each gradient is viewed as a matrix :math:`M` of shape ``(n, m)`` (a conv weight as
    ``(out, in·kh·kw)``); with :math:`M = G + E` (the gradient plus this worker's residual) and
    :math:`Q \in \mathbb{R}^{m \times r}` (last step's, or drawn from a generator shared by all workers):

    .. math::
        P = M Q, \quad P \leftarrow \tfrac1N \textstyle\sum_w P_w \ \text{(all-reduce)}, \quad
        \hat P = \operatorname{orthogonalise}(P) \ \text{(Gram–Schmidt)}, \\
        Q = M^\top \hat P, \quad Q \leftarrow \tfrac1N \textstyle\sum_w Q_w \ \text{(all-reduce)}, \quad
        \text{update} = \hat P Q^\top, \quad E \leftarrow M - \hat P Q^\top.

    The update is :math:`\hat P \hat P^\top \bar M`, the projection of the average :math:`\bar M` onto
    the span of :math:`\hat P`; error feedback subtracts the *aggregated* low-rank result from the local
    input. ``Q`` is kept per parameter (warm start, one power-iteration step per training step) and
    checkpointed. Bytes per matrix and worker: :math:`(n + m)\,r` values (fp32, or fp64 for fp64
    gradients) instead of :math:`n m`.

    Sent uncompressed (averaged): 1-D tensors, matrices where :math:`(n + m)\,r \cdot`
    ``min_compression_rate`` :math:`> n m`, and every tensor before ``start_step``.

    Unlike PyTorch's ``powerSGD_hook``: state is keyed by parameter name (not bucket index, which DDP
    renumbers when it rebuilds buckets), the second all-reduce is issued from the hook's thread (never
    from a future's callback, so ranks cannot pair mismatched messages), and warm-start ``Q`` and residuals
    are saved in Lightning checkpoints.

    Args:
        rank: ``r >= 1``, the rank of the approximation (capped at ``min(n, m)``).
        start_step: optimizer steps of plain averaging before compression starts (PyTorch's hook
            defaults to 1000; the paper starts at once).
        warm_start: reuse last step's ``Q`` (the paper's choice); else a fresh random ``Q`` every step.
        min_compression_rate: compress a matrix only if ``n m >= rate · (n + m) r``.
    """

    name = "powersgd"
    capabilities = frozenset({"whole_bucket"})  # the bucket's flat buffer as it is (the base's segment_alignment)

    def __init__(self, rank: int = 2, start_step: int = 0, warm_start: bool = True,
                 min_compression_rate: float = 2.0) -> None:
        self.rank = rank
        self.start_step = check_int(start_step, "start_step", 0)
        self.warm_start = check_bool(warm_start, "warm_start")
        self.min_compression_rate = check_number(min_compression_rate, "min_compression_rate", "a finite number >= 1",
                                                 lambda value: 1.0 <= value < math.inf)

    @property
    def rank(self) -> int:
        """The rank ``r >= 1`` of the approximation; a schedule may change it between steps."""
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = check_int(value, "rank", 1)

    def hparams(self) -> dict[str, Any]:
        return {"rank": self.rank, "start_step": self.start_step, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate}

    # ------------------------------------------------------------------ shapes and wire
    def matrix_shape(self, shape: Sequence[int]) -> Optional[tuple[int, int, int]]:
        """``(n, m, r)`` for a parameter of ``shape`` that is compressed, ``None`` for one sent dense."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = math.prod(shape) // n if n else 0
        r = min(self.rank, n, m)
        if r == 0 or (n + m) * r * self.min_compression_rate > n * m:
            return None
        return n, m, r

    def wire_format(self, shape: Sequence[int], dtype: torch.dtype, count: Optional[int] = None,
                    world_size: int = 1) -> list[list[tuple[torch.dtype, int]]]:
        """From ``start_step`` on: ``P`` (``n·r``) in round 1, ``Q`` (``m·r``) in round 2; or the dense tensor."""
        matrix = self.matrix_shape(shape)
        if matrix is None:
            return [[(dtype, math.prod(shape))]]
        n, m, r = matrix
        compute = _compute_dtype(dtype)
        return [[(compute, n * r)], [(compute, m * r)]]

    # ------------------------------------------------------------------ the protocol
    def exchange(self, tensor: Tensor, ctx: CompressContext) -> Protocol:
        matrix = self.matrix_shape(ctx.shape) if ctx.shape else None
        if matrix is None or ctx.step < self.start_step:  # averaged uncompressed, in the gradient's dtype
            (mean,) = yield Round([Mean(tensor.to(ctx.wire_dtype(tensor)))], last=True)
            return Outcome(tensor.numel(), lambda residual: residual.zero_(), lambda out: out.copy_(mean))
        n, m, r = matrix
        compute = _compute_dtype(tensor.dtype)
        local = tensor.view(n, m).to(compute)
        q = self._start_q(ctx, m, r, compute, tensor.device)
        with full_precision_matmuls():
            p_local = local @ q
        (p_mean,) = yield Round([Mean(p_local)])
        with full_precision_matmuls():
            p_hat = orthogonalize(p_mean.clone())
            q_local = local.T @ p_hat
        (q_mean,) = yield Round([Mean(q_local)], last=True)
        if self.warm_start:  # committed like the bucket on every worker; a void step keeps the last Q
            ctx.commit(Q_STATE, q_mean.clone(), check_result=True)

        def subtract(residual: Tensor) -> None:
            with full_precision_matmuls():
                residual.view(n, m).addmm_(p_hat.to(residual.dtype), q_mean.T.to(residual.dtype), alpha=-1.0)

        def write(out: Tensor) -> None:
            with full_precision_matmuls():
                if out.dtype == p_hat.dtype:
                    torch.mm(p_hat, q_mean.T, out=out.view(n, m))
                else:
                    out.view(n, m).copy_(p_hat @ q_mean.T)

        return Outcome((n + m) * r, subtract, write)

    # ------------------------------------------------------------------ a whole bucket at once
    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        return True  # any sizes: the plan of groups handles each tensor's shape

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """The same power step for every matrix, one batched product per group of matrices of one shape
        (:class:`_Batches`): ``P = M Q`` and ``Q = Mᵀ P̂`` by ``bmm``, Gram–Schmidt on the batch; the tensors
        sent averaged in the first round."""
        device = flat.device
        compute = _compute_dtype(contexts[0].dtype or flat.dtype)
        compressing = contexts[0].step >= self.start_step
        batches: _Batches = segments.constant(("powersgd", self.rank, self.min_compression_rate, compressing),
                                              device, lambda device: _Batches(self, segments, compressing, device))
        wire = contexts[0].wire_dtype(flat)
        views = segments.views(flat)
        averaged = _joined([views[index] for index in batches.averaged]).to(wire) if batches.averaged else None
        if not batches.groups:
            (mean,) = yield Round([Mean(averaged)], last=True)
            return SegmentsOutcome(segments.numels, lambda residual: residual.zero_(),
                                   lambda out: out.copy_(mean.to(out.dtype)), overwrites=True)
        # every matrix, group after group; possibly a view of `flat`: read before the last round only (the
        # residual's update changes `flat` afterwards)
        gathered = _joined([views[index] for index in batches.q_order]).to(compute)
        matrices = {shape: gathered[start:stop].view(-1, shape[0], shape[1])
                    for shape, (start, stop) in batches.matrix_spans.items()}
        q_flat = self._start_q_segments(state, batches, contexts, compute, device)
        q_views, offset = {}, 0
        for (n, m, r), members in batches.groups.items():
            q_views[(n, m, r)] = q_flat[offset:offset + len(members) * m * r].view(len(members), m, r)
            offset += len(members) * m * r
        with full_precision_matmuls():
            requests = [Mean(torch.bmm(matrices[shape], q_views[shape])) for shape in batches.groups]
        results = yield Round(requests + ([Mean(averaged)] if averaged is not None else []))
        with full_precision_matmuls():
            p_hats = batches.orthogonalize(results[:len(batches.groups)])
            q_requests = [Mean(torch.bmm(matrices[shape].transpose(1, 2), p_hats[shape])) for shape in batches.groups]
        averaged_mean = results[-1] if averaged is not None else None
        q_means = yield Round(q_requests, last=True)
        q_means = dict(zip(batches.groups, q_means))
        if self.warm_start:  # committed like the bucket on every worker; a void step keeps the last Q
            state.commit(Q_STATE, torch.cat([q_means[shape].reshape(-1) for shape in batches.groups]),
                         batches.q_layout, check_result=True)
        products: list[Tensor] = []

        def product() -> Tensor:  # every matrix's P̂ Qᵀ, group after group (as batches.q_order)
            if not products:
                with full_precision_matmuls():
                    pieces = [torch.bmm(p_hats[shape], q_means[shape].transpose(1, 2)).reshape(-1)
                              for shape in batches.groups]
                products.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            return products[0]

        def subtract(residual: Tensor) -> None:  # one multi-tensor op each, on contiguous 1-D views
            parts = segments.views(residual)
            torch._foreach_sub_([parts[index] for index in batches.q_order],
                                batches.matrix_layout.views(product().to(residual.dtype)))
            if averaged is not None:
                torch._foreach_zero_([parts[index] for index in batches.averaged])

        def write(out: Tensor) -> None:
            parts = segments.views(out)
            torch._foreach_copy_([parts[index] for index in batches.q_order],
                                 batches.matrix_layout.views(product().to(out.dtype)))
            if averaged_mean is not None:
                torch._foreach_copy_([parts[index] for index in batches.averaged],
                                     batches.averaged_layout.views(averaged_mean.to(out.dtype)))

        counts = [segments.numels[index] for index in range(len(segments))]
        for (n, m, r), members in batches.groups.items():
            for index in members:
                counts[index] = (n + m) * r
        return SegmentsOutcome(counts, subtract, write, overwrites=True)  # every tensor written (no gaps)

    def _start_q_segments(self, state: SegmentsState, batches: _Batches, contexts: Sequence[CompressContext],
                          dtype: torch.dtype, device: torch.device) -> Tensor:
        """Every matrix's ``Q`` in the layout of ``batches.q_layout``: last step's where kept, else drawn
        as :meth:`_start_q` draws it (per tensor: only on the first step, or every step without warm start)."""
        present = state.present(Q_STATE, batches.q_layout) if self.warm_start else [False] * len(batches.q_order)
        kept = state.get(Q_STATE, batches.q_layout) if any(present) else None
        if all(present) and kept is not None:
            return kept.to(dtype)
        q_flat = (torch.zeros(batches.q_layout.total, dtype=dtype, device=device) if kept is None
                  else kept.to(dtype, copy=True))
        for view, index, found, shape in zip(batches.q_layout.views(q_flat), batches.q_order, present,
                                             batches.q_layout.shapes):
            if not found:
                generator = contexts[index].generator(shared_draw_generator_device(), per_rank=False)
                view.copy_(to_device(torch.randn(*shape, generator=generator, dtype=dtype), device).view(-1))
        return q_flat

    def _start_q(self, ctx: CompressContext, m: int, r: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        previous = ctx.state.get(Q_STATE) if self.warm_start else None
        if previous is not None and previous.shape == (m, r):
            return previous.to(dtype)
        # the same Q on every worker: drawn on the CPU (a GPU generator's draws depend on the GPU model)
        generator = ctx.generator(shared_draw_generator_device(), per_rank=False)
        return to_device(torch.randn(m, r, generator=generator, dtype=dtype), device)

class _Batches:
    """The bucket's matrices grouped by ``(n, m, r)`` (one batched product per group), the tensors sent
    averaged, and the layout of the warm-start ``Q`` (group after group, so a group's ``Q`` is a view)."""

    def __init__(self, compressor: "PowerSGD", segments: Segments, compressing: bool, device: torch.device) -> None:
        self.groups: dict[tuple[int, int, int], list[int]] = {}
        self.averaged: list[int] = []
        for index, shape in enumerate(segments.shapes):
            matrix = compressor.matrix_shape(shape) if compressing else None
            if matrix is None:
                self.averaged.append(index)
            else:
                self.groups.setdefault(matrix, []).append(index)
        order = [index for members in self.groups.values() for index in members]
        self.q_layout = Segments(tuple(segments.names[index] for index in order),
                                 tuple((shape[1], shape[2]) for shape, members in self.groups.items()
                                       for _ in members), 1)
        self.q_order = order
        #: the compressed matrices one after another, group after group, and the tensors sent averaged: the
        #: layouts of the buffers joined from the flat buffer's views (no index of elements)
        self.matrix_layout = Segments(tuple(segments.names[index] for index in order),
                                      tuple((segments.numels[index],) for index in order), 1)
        self.averaged_layout = Segments(tuple(segments.names[index] for index in self.averaged),
                                        tuple((segments.numels[index],) for index in self.averaged), 1)
        #: each group's span of the joined matrices
        self.matrix_spans: dict[tuple[int, int, int], tuple[int, int]] = {}
        start = 0
        for (n, m, r), members in self.groups.items():
            self.matrix_spans[(n, m, r)] = (start, start + len(members) * n * m)
            start += len(members) * n * m
        # Gram–Schmidt of every group's P at once: one zero-padded (matrices, n_max, r_max) batch
        self.n_max = max((n for n, _, _ in self.groups), default=0)
        self.r_max = max((r for _, _, r in self.groups), default=0)
        self.batch = len(order)
        pad_index, first = [], 0
        for (n, m, r), members in self.groups.items():
            matrices = torch.arange(first, first + len(members)).view(-1, 1, 1)
            rows = matrices * self.n_max + torch.arange(n).view(1, -1, 1)
            pad_index.append((rows * self.r_max + torch.arange(r).view(1, 1, -1)).reshape(-1))
            first += len(members)
        self.pad_index = to_device(torch.cat(pad_index), device) if pad_index else None
        # one padded batch while it stays small (P is n·r per matrix: 330k elements for a ResNet-50 bucket)
        # or within 4x the real P's: one tall matrix (an embedding) among many short ones would multiply the
        # work; then one Gram–Schmidt per group
        real = sum(len(members) * n * r for (n, _, r), members in self.groups.items())
        self.pad_all = len(self.groups) > 1 and self.batch * self.n_max * self.r_max <= max(PAD_RATIO * real,
                                                                                            PAD_LIMIT)

    def orthogonalize(self, p_means: Sequence[Tensor]) -> dict[tuple[int, int, int], Tensor]:
        """:func:`orthogonalize_batched` of every group's averaged ``P`` (read-only results): for several
        groups one zero-padded batch of them all (zero rows and trailing zero columns change no column's
        norm or projection) and views of it per group, unless the padded batch is both large
        (:data:`PAD_LIMIT`) and more than 4x the real one; else one batch per group."""
        if not self.pad_all:
            return {shape: orthogonalize_batched(p_mean.clone()) for shape, p_mean in zip(self.groups, p_means)}
        padded = p_means[0].new_zeros(self.batch * self.n_max * self.r_max)
        padded.index_copy_(0, self.pad_index, torch.cat([p_mean.reshape(-1) for p_mean in p_means]))
        batch = orthogonalize_batched(padded.view(self.batch, self.n_max, self.r_max))
        views, first = {}, 0
        for (n, m, r), members in self.groups.items():
            views[(n, m, r)] = batch[first:first + len(members), :n, :r]
            first += len(members)
        return views


def _joined(views: Sequence[Tensor]) -> Tensor:
    """The tensors one after another: a view when they already are, in memory (a lone matrix; neighbours of
    one flat buffer), else a new buffer (one ``cat``: no index of elements to keep). Read only."""
    first = views[0]
    size = first.element_size()
    adjacent = all(view.is_contiguous() and view.dtype == first.dtype and
                   view.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for view in views) and all(
        after.data_ptr() == before.data_ptr() + before.numel() * size for before, after in zip(views, views[1:]))
    if adjacent:
        return first.reshape(-1) if len(views) == 1 else first.as_strided((sum(view.numel() for view in views),), (1,))
    return torch.cat(list(views))


def orthogonalize_batched(matrices: Tensor) -> Tensor:
    """:func:`orthogonalize` of every matrix of a ``(G, n, r)`` batch at once (in place; returned)."""
    tiny = torch.finfo(matrices.dtype).tiny
    columns = matrices.shape[2]
    for i in range(columns):
        column = matrices[:, :, i:i + 1]
        column.div_(torch.linalg.vector_norm(column, dim=1, keepdim=True).clamp_min(tiny))
        if i + 1 < columns:
            rest = matrices[:, :, i + 1:]
            rest.sub_(column @ (column.transpose(1, 2) @ rest))
    return matrices


def orthogonalize(matrix: Tensor) -> Tensor:
    """Gram–Schmidt on the columns of ``matrix`` (in place; returned). A zero column stays zero."""
    tiny = torch.finfo(matrix.dtype).tiny
    columns = matrix.shape[1]
    for i in range(columns):
        column = matrix[:, i:i + 1]
        column.div_(torch.linalg.vector_norm(column).clamp_min(tiny))
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest.sub_(column @ (column.T @ rest))
    return matrix


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
