"""An independent oracle of one exchange step: what the aggregate must be, computed from each worker's
own compression of its own input, without the engine (no merging, no wire layout, no drivers).

For a one-round compressor the aggregate is the mean over workers of each worker's decoded payload
``D(C(p_w))`` (then the compressor's ``finalize``), with ``p_w = g_w + e_w`` under error feedback; tensors
below the size threshold are the mean of what each worker sends dense. The methods with a protocol of
their own get their definition written out here: signSGD's majority vote, PowerSGD's projection of the
mean onto the span of the averaged ``P`` (orthogonalised by QR, not by the package's Gram-Schmidt), the
quantised all-reduce's average of every worker's quantised chunk, re-quantised by its owner.
"""

from __future__ import annotations

import copy
import math

import torch

from lightning_gradcomp.compressors import CompressContext, Compressor, DeMo, Payload, PowerSGD, SignSGD, SparseLoCo
from lightning_gradcomp.compressors.powersgd import Q_STATE
from lightning_gradcomp.compressors.quantised import OWNER_RESIDUAL, _QuantisedAllReduce
from lightning_gradcomp.compressors.sparseloco import ACCUMULATOR
from lightning_gradcomp.exchange.simulated import SimulatedExchange


def expected_aggregate(exchange: SimulatedExchange, named_grads: list[list[tuple[str, torch.Tensor]]],
                       shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The aggregate of the exchange's next step, for every worker's gradients ``named_grads[w]``,
    computed before the step from copies of every worker's memory."""
    compressor = exchange.compressor
    workers = exchange.workers
    step = exchange.step
    out = {}
    for name, shape in shapes.items():
        inputs, contexts = [], []
        for worker in range(workers):
            memory = exchange.pipelines[worker].memory
            grad = dict(named_grads[worker])[name].reshape(-1)
            ctx = CompressContext(name, step, worker, workers, exchange.seed,
                                  copy.deepcopy(memory.states.get(name, {})), tuple(shape), True, grad.dtype)
            compressed = grad.numel() >= exchange.min_compress_numel
            residual = memory.residuals.get(name) if exchange.error_feedback and compressed else None
            inputs.append((grad.float() + residual) if residual is not None else grad.float() if compressed else grad)
            contexts.append(ctx)
        if inputs[0].numel() < exchange.min_compress_numel:
            out[name] = _summed([compressor.dense(x, ctx) for x, ctx in zip(inputs, contexts)]).double()
            compressor.finalize_dense(out[name], contexts[0])
        elif isinstance(compressor, SignSGD):
            out[name] = _majority_vote(compressor, inputs, contexts)
        elif isinstance(compressor, PowerSGD):
            out[name] = _power_step(compressor, inputs, contexts)
        elif isinstance(compressor, DeMo):
            momenta = [demo_spatial(ctx.state.get("momentum"), shape, compressor.chunk) for ctx in contexts]
            out[name] = demo_aggregate(inputs, momenta, shape, compressor.chunk, compressor.k, compressor.decay,
                                       compressor.sign)[0]
        elif isinstance(compressor, SparseLoCo) and compressor.aggregate == "chosen":
            out[name] = _mean_over_choosers(compressor, inputs, contexts)
        elif isinstance(compressor, _QuantisedAllReduce):
            out[name] = _quantised_all_reduce(compressor, inputs, contexts)
        else:
            out[name] = _mean_of_decoded(compressor, inputs, contexts)
    return out


def _summed(values: list[torch.Tensor]) -> torch.Tensor:
    """``Σ_w values[w] / N`` in the values' own dtype: what an all-reduce of 16-bit values computes."""
    total = values[0] / len(values)
    for value in values[1:]:
        total = total + value / len(values)
    return total


def _mean_of_decoded(compressor: Compressor, inputs: list[torch.Tensor], contexts: list[CompressContext]) -> torch.Tensor:
    payloads = [compressor.compress(x, ctx) for x, ctx in zip(inputs, contexts)]
    if compressor.all_reducible:  # summed on the wire, in the payload's dtype, then decoded once
        first = payloads[0]
        summed = tuple(_summed([payload.parts[i] for payload in payloads]) for i in range(len(first.parts)))
        mean = compressor.decompress(Payload(summed, first.numel, first.count, first.meta), torch.float64)
    else:
        mean = torch.stack([compressor.decompress(payload, torch.float64) for payload in payloads]).mean(0)
    compressor.finalize(mean, contexts[0])
    return mean


def _mean_over_choosers(compressor: SparseLoCo, inputs: list[torch.Tensor],
                        contexts: list[CompressContext]) -> torch.Tensor:
    """SparseLoCo's aggregate: at each coordinate the mean of the decoded values of the workers whose
    chunk-wise top-k of ``|β·A + p|`` chose it (the choice recomputed here with ``torch.topk``)."""
    total = torch.zeros(inputs[0].numel(), dtype=torch.float64)
    chosen = torch.zeros_like(total)
    for x, ctx in zip(inputs, contexts):
        previous = ctx.state.get(ACCUMULATOR)
        accumulator = x.double() + (compressor.decay * previous.double() if previous is not None else 0.0)
        numel = accumulator.numel()
        length = min(compressor.chunk, numel)
        chunks = -(-numel // length)
        magnitudes = torch.full((chunks * length,), -1.0, dtype=torch.float64)
        magnitudes[:numel] = accumulator.abs()
        top = magnitudes.view(chunks, length).topk(min(compressor.k, length), dim=1).indices
        top = (top + torch.arange(chunks).unsqueeze(1) * length).reshape(-1)
        chosen[top[top < numel]] += 1.0
        total += compressor.decompress(compressor.compress(x, ctx), torch.float64)
    return total / chosen.clamp(min=1.0)


def _majority_vote(compressor: SignSGD, inputs: list[torch.Tensor], contexts: list[CompressContext]) -> torch.Tensor:
    """sign(Σ_w sign(v_w)) · mean of the workers' scales, with a zero sent as +."""
    signs, scales = [], []
    for x, ctx in zip(inputs, contexts):
        voted = compressor._voted(x, ctx).double()
        signs.append(torch.where(voted < 0, -1.0, 1.0).double())
        scales.append(1.0 if compressor.scale == "none" else float(voted.abs().mean()))
    return torch.stack(signs).sum(0).sign() * (sum(scales) / len(scales))


def _power_step(compressor: PowerSGD, inputs: list[torch.Tensor], contexts: list[CompressContext]) -> torch.Tensor:
    """P̂ P̂ᵀ mean(M_w), P̂ an orthonormal basis of mean(M_w Q); Q the kept one, or the shared first draw."""
    matrix = compressor.matrix_shape(contexts[0].shape) if contexts[0].step >= compressor.start_step else None
    if matrix is None:
        return torch.stack([x.double() for x in inputs]).mean(0)
    n, m, r = matrix
    kept = contexts[0].state.get(Q_STATE)
    q = compressor._start_q(contexts[0], m, r, torch.float32, inputs[0].device) if kept is None else kept
    mats = [x.view(n, m).double() for x in inputs]
    p = torch.stack([mat @ q.double() for mat in mats]).mean(0)
    basis = torch.linalg.qr(p).Q
    return (basis @ basis.T @ torch.stack(mats).mean(0)).reshape(-1)


def _quantised_all_reduce(compressor: _QuantisedAllReduce, inputs: list[torch.Tensor],
                          contexts: list[CompressContext]) -> torch.Tensor:
    """Per chunk: the mean of every worker's quantised version, plus its owner's residual, quantised."""
    workers, numel = len(inputs), inputs[0].numel()
    chunk = padded = compressor._chunk(numel, workers)  # whole blocks; the last chunks hold the padding
    result = torch.zeros(numel, dtype=torch.float64)
    for owner in range(workers):
        start, stop = owner * chunk, min(numel, (owner + 1) * chunk)
        if start >= stop:
            continue
        versions = []
        for x in inputs:
            part = torch.zeros(padded)
            part[: stop - start] = x[start:stop].float()
            versions.append(compressor._decode(*compressor._encode(part.view(-1, compressor.block_size))))
        mean = torch.stack(versions).mean(0)
        residual = contexts[owner].state.get(OWNER_RESIDUAL)
        if compressor.owner_error_feedback and residual is not None:
            mean = mean + residual
        requantised = compressor._decode(*compressor._encode(mean)).reshape(-1)
        result[start:stop] = requantised[: stop - start].double()
    return result


def _dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix from its definition, element by element, in float64."""
    out = torch.empty(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            out[i, j] = math.sqrt((1.0 if i == 0 else 2.0) / n) * math.cos(math.pi * (2 * j + 1) * i / (2 * n))
    return out


def _divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _demo_tiles(numel: int, shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    rows = shape[0] if len(shape) >= 2 else 1
    cols = numel // rows
    return rows, cols, _divisor(rows, chunk), _divisor(cols, chunk)


def demo_spatial(state, shape: tuple[int, ...], chunk: int):
    """DeMo's momentum from the package's state (each tile's DCT coefficients, tile after tile in row-major
    order of the tiles), back in the parameter's own layout, flat; ``None`` stays ``None``."""
    if state is None:
        return None
    rows, cols, a, b = _demo_tiles(state.numel(), shape, chunk)
    d_a, d_b = _dct(a), _dct(b)
    coefficients = state.double().reshape(-1, a, b)
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for index, (y, z) in enumerate((y, z) for y in range(0, rows, a) for z in range(0, cols, b)):
        out[y:y + a, z:z + b] = d_a.T @ coefficients[index] @ d_b
    return out.reshape(-1)


def demo_aggregate(inputs: list[torch.Tensor], momenta: list, shape: tuple[int, ...], chunk: int, k: int,
                   decay: float, sign: bool, lr: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """DeMo's steps 2 to 6 (and the sign) in float64, tile by tile: ``δ_w = β·δ_w + η·x_w``; per tile
    ``C = D_a·T·D_bᵀ`` of ``δ_w``, its ``k`` largest ``|C|`` chosen, removed from ``δ_w``; per coefficient
    the mean over the workers that chose it, ``D_aᵀ·M·D_b``. Returns the flat aggregate and the new
    momenta."""
    rows, cols, a, b = _demo_tiles(inputs[0].numel(), shape, chunk)
    d_a, d_b = _dct(a), _dct(b)
    total = torch.zeros(rows, cols, dtype=torch.float64)
    chosen = torch.zeros(rows, cols, dtype=torch.float64)
    new_momenta = []
    for x, previous in zip(inputs, momenta):
        delta = lr * x.double().reshape(rows, cols)
        if previous is not None:
            delta = delta + decay * previous.double().reshape(rows, cols)
        for y in range(0, rows, a):
            for z in range(0, cols, b):
                coefficients = d_a @ delta[y:y + a, z:z + b] @ d_b.T
                top = coefficients.reshape(-1).abs().topk(min(k, a * b)).indices
                sent, mask = torch.zeros(a * b, dtype=torch.float64), torch.zeros(a * b, dtype=torch.float64)
                sent[top], mask[top] = coefficients.reshape(-1)[top], 1.0
                sent = sent.reshape(a, b)
                delta[y:y + a, z:z + b] -= d_a.T @ sent @ d_b
                total[y:y + a, z:z + b] += sent
                chosen[y:y + a, z:z + b] += mask.reshape(a, b)
        new_momenta.append(delta.reshape(-1))
    mean = total / chosen.clamp(min=1.0)
    result = torch.zeros(rows, cols, dtype=torch.float64)
    for y in range(0, rows, a):
        for z in range(0, cols, b):
            result[y:y + a, z:z + b] = d_a.T @ mean[y:y + a, z:z + b] @ d_b
    result = result.reshape(-1)
    return (result.sign() if sign else result), new_momenta
