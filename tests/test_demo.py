"""DeMo against a float64 reference of its seven steps (2 workers, several optimizer steps), its tiling and
wire format counted at the collective, tensors sent dense, the optimizer it accepts, and its use every
step in a Lightning run and as the outer compressor of local updates; step 2's learning rate per parameter
group (a schedule changing the groups' ratio) against a re-implementation of the authors' DeMo optimizer,
directly, in the simulated strategy and through register()'s handle."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_gradcomp.compressors import DeMo
from lightning_gradcomp.compressors.bitpack import packed_nbytes
from lightning_gradcomp.compressors.demo import MOMENTUM, Tiling, dct_matrix, largest_divisor_at_most
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from tests._oracle import demo_aggregate, demo_spatial

#: with chunk=16, tiles of 16 x 16, 10 x 9, 1 x 15 and 16 x 16 again: the bucket-wise path groups the first
#: and the last tensor (its groups are not in the bucket's order)
SHAPES = {"fc.weight": (96, 128), "conv.weight": (20, 6, 3, 3), "fc.bias": (300,), "head.weight": (32, 48)}


def _gradients(params: dict[str, torch.Tensor], worker: int, step: int) -> list[tuple[str, torch.Tensor]]:
    """A gradient that depends on the parameters (a quadratic pull towards a worker's own target), so a
    wrong step changes every later gradient."""
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return [(name, (p - torch.randn(p.shape, generator=generator, dtype=p.dtype)) * (1 + worker))
            for name, p in params.items()]


@pytest.mark.parametrize("bucket_wise", [False, True], ids=["per-tensor", "bucket-wise"])
@pytest.mark.parametrize("sign", [True, False])
def test_two_workers_match_the_float64_reference_of_the_seven_steps(sign: bool, bucket_wise: bool) -> None:
    """SGD(lr, weight_decay) fed by the exchange against steps 1-7 in float64 (DCT from its definition,
    tile by tile): parameters after every step, and each worker's momentum; per tensor (the CPU's path)
    and a whole bucket at once (the accelerators' path, tensors grouped by tile shape). With the sign, a
    coordinate whose aggregate is within rounding of 0 may take the other sign: at most 0.1% of them,
    and the reference goes on from the package's parameters and momenta so such a case does not compound."""
    with accelerator_path() if bucket_wise else contextlib.nullcontext():
        _match_the_float64_reference(sign, bucket_wise)


def _match_the_float64_reference(sign: bool, bucket_wise: bool) -> None:
    lr, weight_decay, decay = 0.01, 0.1, 0.9
    compressor = DeMo(chunk=16, k=5, decay=decay, sign=sign)
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in SHAPES.items()}
    optimizer = torch.optim.SGD(params.values(), lr=lr, weight_decay=weight_decay)
    compressor.check_optimizer(optimizer)  # binds the learning rate of step 2
    exchange = SimulatedExchange(compressor, 2, min_compress_numel=0)
    assert (compressor.segment_alignment(torch.device("cpu")) is not None) == bucket_wise
    momenta: dict[str, list] = {name: [None, None] for name in SHAPES}
    for step in range(4):
        lr = 0.01 * (1 - 0.2 * step)  # a schedule: step 2 weighs each gradient by its step's learning rate
        optimizer.param_groups[0]["lr"] = lr
        reference = {name: p.detach().double().clone() for name, p in params.items()}
        grads = [_gradients({n: p.detach() for n, p in params.items()}, worker, step) for worker in range(2)]
        for worker in range(2):
            exchange.add_worker(worker, [(name, g.clone()) for name, g in grads[worker]])
        aggregate = exchange.finish_step()
        for name, p in params.items():
            p.grad = aggregate[name].view(p.shape).clone()
        optimizer.step()
        for name, shape in SHAPES.items():
            inputs = [dict(grads[worker])[name].reshape(-1) for worker in range(2)]
            direction, momenta[name] = demo_aggregate(inputs, momenta[name], shape, 16, 5, decay, sign, lr=lr)
            expected = reference[name].reshape(-1) * (1 - lr * weight_decay) - lr * direction  # steps 1 and 7
            actual = params[name].detach().double().reshape(-1)
            close = torch.isclose(actual, expected, rtol=1e-5, atol=1e-6).double().mean().item()
            assert close >= (0.999 if sign else 1.0), (step, name, close)
            for worker in range(2):  # the package keeps the momentum's DCT coefficients
                state = demo_spatial(exchange.pipelines[worker].memory.states[name][MOMENTUM], shape, 16)
                torch.testing.assert_close(state, momenta[name][worker], rtol=1e-5, atol=1e-6)
                momenta[name][worker] = state


def test_tiles_are_the_largest_divisors_at_most_the_chunk() -> None:
    assert [largest_divisor_at_most(n, 64) for n in (4096, 784, 10, 127, 1)] == [64, 56, 10, 1, 1]
    assert Tiling.of(512 * 256, (512, 256), 64, 32) == Tiling(512, 256, 64, 64, 32)
    assert Tiling.of(10 * 784, (10, 784), 64, 32) == Tiling(10, 784, 10, 56, 32)
    assert Tiling.of(64 * 27, (64, 3, 3, 3), 64, 32) == Tiling(64, 27, 64, 27, 32)  # a convolution: (out, in·h·w)
    assert Tiling.of(640, (640,), 64, 32) == Tiling(1, 640, 1, 64, 32)  # a 1-D tensor: chunks of 64
    assert Tiling.of(127, (127,), 64, 32).k == 1  # a prime length: tiles of one element, each sent
    d = dct_matrix(64, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(d @ d.T, torch.eye(64, dtype=torch.float64))
    tiling = Tiling.of(192 * 80, (192, 80), 64, 32)
    x = torch.randn(192 * 80, dtype=torch.float64)
    torch.testing.assert_close(tiling.decode(tiling.encode(x)), x)


@pytest.mark.parametrize("value_dtype,value_bytes", [(None, 4), ("bfloat16", 2)])
def test_bytes_handed_to_the_collective_are_twelve_bit_indices_and_the_values(value_dtype, value_bytes: int) -> None:
    compressor = DeMo(value_dtype=value_dtype)  # 32 of every 64 x 64 tile
    exchange = SimulatedExchange(compressor, 2, min_compress_numel=0)
    for worker in range(2):
        exchange.add_worker(worker, [("w", torch.randn(256, 512))])
    exchange.finish_step()
    count = 32 * (256 // 64) * (512 // 64)
    payload = packed_nbytes(count, 12) + count * value_bytes
    assert packed_nbytes(count, 12) == count * 12 // 8
    assert compressor.wire_format((256, 512), torch.float32) == [[(torch.uint8, count * 12 // 8),
                                                                   ({None: torch.float32}.get(value_dtype, torch.bfloat16), count)]]
    flag = 4  # the bucket's verdict flag rides with the gather, whose buffer is padded to 8 bytes
    assert exchange.step_stats.bytes_sent == -(-(payload + flag) // 8) * 8
    assert 256 * 512 * 4 / payload > (90 if value_bytes == 4 else 145)


@pytest.mark.parametrize("bucket_wise", [False, True], ids=["per-tensor", "bucket-wise"])
def test_a_tensor_sent_dense_steps_along_the_sign_of_the_averaged_momentum(bucket_wise: bool) -> None:
    compressor = DeMo(decay=0.5)
    exchange = SimulatedExchange(compressor, 2, min_compress_numel=1000)
    grads = [[[torch.randn(50), torch.randn(70)] for _ in range(2)] for _ in range(2)]  # [step][worker][tensor]
    for step in range(2):
        with accelerator_path() if bucket_wise else contextlib.nullcontext():
            for worker in range(2):
                exchange.add_worker(worker, [("bias", grads[step][worker][0].clone()),
                                             ("norm", grads[step][worker][1].clone())])
            aggregate = exchange.finish_step()
        for index, name in enumerate(("bias", "norm")):  # all sent: δ = g, then δ ← 0
            assert torch.equal(aggregate[name], (grads[step][0][index] + grads[step][1][index]).sign())
            assert not exchange.pipelines[0].memory.states[name][MOMENTUM].any()


def _run_steps(exchange: SimulatedExchange, steps: range, bucket_wise: bool) -> list[dict[str, torch.Tensor]]:
    """Steps of 3 workers on SHAPES' gradients (seeded by step and worker)."""
    results = []
    for step in steps:
        with accelerator_path() if bucket_wise else contextlib.nullcontext():
            for worker in range(exchange.workers):
                generator = torch.Generator().manual_seed(100 * step + worker)
                exchange.add_worker(worker, [(name, torch.randn(shape, generator=generator))
                                             for name, shape in SHAPES.items()])
            results.append(exchange.finish_step())
    return results


@pytest.mark.parametrize("bucket_wise", [False, True], ids=["per-tensor-first", "bucket-wise-first"])
def test_a_checkpoint_resumes_on_the_other_path_and_another_chunk_restarts_the_momentum(bucket_wise: bool) -> None:
    """The bucket-wise momentum is kept per parameter as ``(tiles, a·b)`` coefficients, as per tensor: a
    checkpoint of one path resumes on the other (equal to rounding), and one taken with another
    ``chunk`` (another tiling, the same number of coefficients) starts the momentum afresh on both."""
    first = SimulatedExchange(DeMo(chunk=16, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
    _run_steps(first, range(2), bucket_wise)
    states = first.state_dicts()
    expected = _run_steps(first, range(2, 4), bucket_wise)
    resumed = SimulatedExchange(DeMo(chunk=16, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
    resumed.load_state_dicts(states, torch.device("cpu"))
    for want, got in zip(expected, _run_steps(resumed, range(2, 4), not bucket_wise)):
        for name in SHAPES:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
    fresh = SimulatedExchange(DeMo(chunk=8, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
    other_chunk = SimulatedExchange(DeMo(chunk=8, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
    other_chunk.load_state_dicts(states, torch.device("cpu"))
    for path in (bucket_wise, not bucket_wise):
        want, got = _run_steps(fresh, range(2, 3), path)[0], _run_steps(other_chunk, range(2, 3), path)[0]
        for name in SHAPES:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
        fresh = SimulatedExchange(DeMo(chunk=8, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
        other_chunk = SimulatedExchange(DeMo(chunk=8, k=5, decay=0.9, sign=False), 3, min_compress_numel=0)
        other_chunk.load_state_dicts(states, torch.device("cpu"))


@pytest.mark.parametrize("optimizer,match", [
    (lambda p: torch.optim.AdamW(p), r"keeps moments \(betas=\(0.9, 0.999\), param group 0\)"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "applies momentum=0.9 too"),
    (lambda p: torch.optim.RMSprop(p), "but the optimizer is RMSprop; allowed: torch.optim.SGD with momentum=0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "param group 0 has maximize=True"),
])
def test_an_optimizer_with_momentum_of_its_own_is_refused(optimizer, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeMo().check_optimizer(optimizer([torch.nn.Parameter(torch.zeros(3))]))


@pytest.mark.filterwarnings("ignore:DeMo. parameter 'w'")  # every coefficient sent, on purpose
def test_the_learning_rate_of_step_two_follows_the_optimizer() -> None:
    """δ ← β·δ + η_t·g with η_t read at every step (a schedule), η = 1 before binding."""
    compressor = DeMo(decay=0.5, chunk=8, k=64)  # every coefficient sent: δ is emptied each step
    parameter = torch.nn.Parameter(torch.zeros(8, 8))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    exchange = SimulatedExchange(compressor, 1, min_compress_numel=0)
    compressor_unbound = DeMo(decay=0.5, chunk=8, k=64, sign=False)
    unbound = SimulatedExchange(compressor_unbound, 1, min_compress_numel=0)
    g = torch.randn(64)
    unbound.add_worker(0, [("w", g.clone())])
    torch.testing.assert_close(unbound.finish_step()["w"], g, rtol=1e-5, atol=1e-6)
    compressor.sign = False
    compressor.check_optimizer(optimizer)
    for lr in (0.5, 0.25):
        optimizer.param_groups[0]["lr"] = lr
        exchange.add_worker(0, [("w", g.clone())])
        torch.testing.assert_close(exchange.finish_step()["w"], lr * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk": 0}, "`chunk` must be an integer >= 1"),
    ({"k": 0}, "`k` must be an integer >= 1"),
    ({"decay": 1.0}, r"`decay` must be a number in \[0, 1\)"),
    ({"sign": "yes"}, "`sign` must be"),
    ({"value_dtype": "float8"}, "`value_dtype` must be None or one of 'float16', 'bfloat16'"),
])
def test_bad_arguments_name_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeMo(**kwargs)


def test_the_compressor_pickles_without_its_optimizer() -> None:
    import pickle

    compressor = DeMo(k=8)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.3)
    compressor.check_optimizer(optimizer)
    assert compressor._learning_rate() == 0.3
    copy = pickle.loads(pickle.dumps(compressor))
    assert copy.k == 8 and copy._learning_rate() == 1.0


def _digits_fit(tmp_path, optimizer: str = "sgd", epochs: int = 4):
    """The digits classifier in the simulated strategy of 2 workers, DeMo every step; validation accuracy."""
    import lightning as L

    from lightning_gradcomp import GradCompSimStrategy
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    class Classifier(DigitsClassifier):
        def configure_optimizers(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
            return super().configure_optimizers()

    L.seed_everything(0, verbose=False)
    model = Classifier(hidden=64, lr=0.01, weight_decay=0.01)
    strategy = GradCompSimStrategy(workers=2, compressor=DeMo(chunk=16, k=8))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    datamodule = DigitsDataModule(batch_size=32)
    trainer.fit(model, datamodule=datamodule)
    return trainer.validate(model, datamodule=datamodule, verbose=False)[0]["val_acc"], strategy


def test_demo_trains_every_step_in_the_simulated_strategy(tmp_path) -> None:
    """SGD's learning rate reaches step 2 through the strategy's optimizer check; the digits MLP learns
    (measured: 0.91 after 172 steps; plain SGD at lr 0.1 and no compression: 0.65)."""
    accuracy, strategy = _digits_fit(tmp_path)
    assert strategy.compressor._learning_rate() == 0.01
    assert accuracy >= 0.85, accuracy


def test_the_strategy_refuses_adamw_with_demo_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="DeMo holds the momentum and steps along a sign, but AdamW keeps moments"):
        _digits_fit(tmp_path, optimizer="adamw", epochs=1)


def test_the_byte_transformer_learns_a_text_folder_with_demo(tmp_path) -> None:
    """The language-model example of the benchmarks (examples/text.py) on a small folder of text, DeMo
    every step in the simulated strategy: the training loss falls."""
    import lightning as L

    from lightning_gradcomp import GradCompSimStrategy
    from lightning_gradcomp.examples.text import ByteTransformer, TextCorpusDataModule, read_corpus

    with pytest.raises(FileNotFoundError, match="`corpus`: no \\*.txt files under"):
        read_corpus(str(tmp_path))
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    L.seed_everything(0, verbose=False)
    model = ByteTransformer(context=32, width=32, layers=1, heads=2, optimizer="sgd", lr=3e-3)
    data = TextCorpusDataModule(str(tmp_path), context=32, batch_size=16, val_windows=8)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=GradCompSimStrategy(workers=2, compressor=DeMo(chunk=32, k=8), print_summary=False),
                        callbacks=[Record()], limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_a_value_beyond_float16_stays_in_the_momentum() -> None:
    """With fp16 values a coefficient beyond 65504 is sent as 65504 and the rest stays in the momentum
    (error feedback), instead of inf poisoning it."""
    exchange = SimulatedExchange(DeMo(chunk=8, k=4, value_dtype="float16", sign=False), 1, min_compress_numel=0)
    exchange.add_worker(0, [("w", torch.full((8, 8), 1e4))])  # one 8 x 8 tile; its DC coefficient: 8e4
    aggregate = exchange.finish_step()["w"]
    momentum = exchange.pipelines[0].memory.states["w"][MOMENTUM]
    assert torch.isfinite(aggregate).all() and torch.isfinite(momentum).all()
    assert momentum.abs().max() == pytest.approx(8e4 - 65504, rel=1e-4)


def test_tiles_too_small_to_compress_are_named_in_a_warning() -> None:
    exchange = SimulatedExchange(DeMo(), 1, min_compress_numel=0)
    with pytest.warns(RuntimeWarning, match=r"parameter 'w' of shape \(67, 67\) is cut into tiles of 1 x 1"):
        exchange.add_worker(0, [("w", torch.randn(67, 67))])
    exchange.finish_step()


def test_telemetry_counts_what_stays_in_the_momentum_as_the_error() -> None:
    exchange = SimulatedExchange(DeMo(chunk=16, k=4, sign=False), 1, min_compress_numel=0)
    exchange.telemetry = True
    g = torch.randn(64, 64)
    exchange.add_worker(0, [("w", g.clone())])
    exchange.finish_step()
    exchange.read_measurements()
    momentum = exchange.pipelines[0].memory.states["w"][MOMENTUM]
    assert exchange.totals.error_sq == pytest.approx(float(momentum.double().pow(2).sum()), rel=1e-5)
    assert exchange.totals.grad_sq == pytest.approx(float(g.double().pow(2).sum()), rel=1e-5)  # orthonormal


def test_the_bucket_wise_subtract_takes_back_what_was_sent() -> None:
    """``SegmentsOutcome.subtract`` of DeMo's whole-bucket path (its telemetry uses its own ``error``, but the
    protocol promises it): ``δ -= IDCT(S)`` per tensor, as the per-tensor path's ``accumulate(alpha=-1)``."""
    from lightning_gradcomp.compressors.base import CompressContext
    from lightning_gradcomp.core.protocol import Received
    from lightning_gradcomp.core.segments import Segments

    demo = DeMo(chunk=16, k=5)
    segments = Segments(tuple(SHAPES), tuple(SHAPES.values()), 1)
    flat = torch.randn(segments.total, generator=torch.Generator().manual_seed(0))

    class Empty:  # no state yet
        def get(self, key, layout=None):
            return None

        def commit(self, key, new, layout=None, check_result=False):
            pass

    contexts = [CompressContext(name=name, shape=shape, world_size=1) for name, shape in SHAPES.items()]
    protocol = demo.exchange_segments(flat, segments, contexts, Empty())
    round_ = next(protocol)
    with pytest.raises(StopIteration) as stop:
        protocol.send([[Received(round_.requests[0].parts, None)]])
    taken = flat.clone()
    stop.value.value.subtract(taken)
    for (name, shape), view, after in zip(SHAPES.items(), segments.views(flat), segments.views(taken)):
        expected = view.clone()
        ctx = CompressContext(name=name, shape=shape, world_size=1)
        demo.accumulate(demo.compress(view.clone(), ctx), expected, alpha=-1.0)
        torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


#: buckets (in the bucket's order, by name) for the bucket-wise reading of tiles with chunk=16: ``a`` and
#: ``d`` (1-D, tiles of 1 x 15) are one group, read as runs of elements; in "bands" the 16 x 16 tiles of ``b``
#: and ``c`` (48 columns, their starts a whole number of bands apart, not at the bucket's start) are read as
#: bands, and ``e``'s tiles are as wide as it; in "runs" those of ``b``, ``d`` and ``e`` (48 and 32 columns)
#: as single elements (the worst case). The groups are not in the bucket's order.
TILE_LAYOUTS = {
    "bands": {"a": (45,), "b": (32, 48), "c": (16, 48), "d": (150,), "e": (64, 10)},
    "runs": {"a": (45,), "b": (32, 48), "c": (150,), "d": (16, 48), "e": (32, 32)},
}


@pytest.mark.parametrize("layout", TILE_LAYOUTS, ids=list(TILE_LAYOUTS))
def test_the_bucket_wise_path_reads_and_writes_tiles_in_tile_order(layout: str) -> None:
    """Each group's tiles, read from the bucket by one index of bands or runs, are the tensors' tiles in
    tile order (``Tiling.encode``'s), and writing them back puts every element in its place."""
    from lightning_gradcomp.compressors.demo import _TileGroups
    from lightning_gradcomp.core.segments import Segments

    shapes = TILE_LAYOUTS[layout]
    segments = Segments(tuple(shapes), tuple(shapes.values()), 1)
    plan = _TileGroups(DeMo(chunk=16, k=4), segments, torch.device("cpu"))
    flat = torch.randn(segments.total, dtype=torch.float64)
    members = {(tiling.a, tiling.b): [] for tiling in plan.tilings}
    for index, tiling in enumerate(plan.tilings):
        members[(tiling.a, tiling.b)].append(index)
    written = torch.zeros_like(flat)
    for group, indices in zip(plan.groups, members.values()):
        expected = []
        for index in indices:
            tiling, view = plan.tilings[index], segments.views(flat)[index]
            grid = view.view(tiling.rows // tiling.a, tiling.a, tiling.cols // tiling.b, tiling.b)
            expected.append(grid.transpose(1, 2).reshape(-1, tiling.a, tiling.b))
        tiles = group.read(flat)
        assert torch.equal(tiles, torch.cat(expected))
        group.add_to(written, tiles)
        assert group.index.dtype == torch.int32
    assert torch.equal(written, flat)
    kinds = {(group.a, group.b): group.pieces.shape for group in plan.groups}
    if layout == "bands":  # a band of 16 rows of b or c as its 3 tiles, offset by a; e as one band of 4 tiles
        assert kinds == {(1, 15): (3,), (16, 16): (3, 16, 16), (16, 10): (1, 16, 10)}
        assert plan.groups[1].pieces.offset == 45 and plan.groups[1].index.tolist() == [0, 1, 2]
    else:
        assert kinds == {(1, 15): (3,), (16, 16): (1,)}


@pytest.mark.filterwarnings("ignore:DeMo. parameter")
@pytest.mark.parametrize("layout", TILE_LAYOUTS, ids=list(TILE_LAYOUTS))
def test_a_whole_bucket_equals_the_per_tensor_path_for_any_layout_of_tiles(layout: str) -> None:
    """Three workers, a non-finite gradient at step 2 (the bucket voided, each tensor's momentum kept or
    committed by its own flag), a bucket-wise momentum committed in rows as long as the sizes allow: the
    results and every worker's momentum equal the per-tensor path's to rounding."""
    shapes = TILE_LAYOUTS[layout]
    runs = []
    for bucket_wise in (False, True):
        exchange = SimulatedExchange(DeMo(chunk=16, k=4, decay=0.9, sign=False), 3, min_compress_numel=0)
        for engine in exchange.engines:
            engine.segmented = bucket_wise
        results = []
        with accelerator_path():
            for step in range(4):
                for worker in range(3):
                    generator = torch.Generator().manual_seed(100 * step + worker)
                    grads = [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]
                    if step == 2 and worker == 1:
                        grads[1][1].view(-1)[7] = float("nan")
                    exchange.add_worker(worker, grads)
                with pytest.warns(RuntimeWarning, match="non-finite") if step == 2 else contextlib.nullcontext():
                    results.append(exchange.finish_step())
        runs.append((exchange, results))
    (single, expected), (whole, actual) = runs
    for want, got in zip(expected, actual):
        for name in shapes:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, equal_nan=True)
    for ours, theirs in zip(whole.pipelines, single.pipelines):
        for name in shapes:
            torch.testing.assert_close(ours.memory.states[name][MOMENTUM], theirs.memory.states[name][MOMENTUM],
                                       rtol=1e-5, atol=1e-6)


def test_a_bucket_keeps_an_index_per_band_or_per_run_not_per_element() -> None:
    """Tensors with as many columns: an index per band of 64 rows (a few bytes per 64 x 1001 elements);
    tensors of one tile shape and several column counts: an index per run of a tile's row (4 bytes per 64
    elements); a commit of per-tensor flags spreads them over rows as long as the sizes allow."""
    from lightning_gradcomp.compressors.demo import _TileGroups
    from lightning_gradcomp.core.segments import Segments

    def held(shapes: tuple) -> tuple[int, int, _TileGroups]:
        segments = Segments(tuple(f"w{index}" for index in range(len(shapes))), shapes, 1)
        plan = _TileGroups(DeMo(), segments, torch.device("cpu"))
        indices = sum(group.index.numel() * group.index.element_size() for group in plan.groups)
        return indices, segments.total, plan

    indices, total, plan = held(((1000, 1001),) * 4)  # tiles of 50 x 13: 20 bands a tensor
    assert indices == 4 * 20 * 4 and plan.layout.coarse_rows.rows == 4
    indices, total, plan = held(((768, 768), (768, 3072), (3072, 768)))  # tiles of 64 x 64
    assert indices == total // 64 * 4 and plan.layout.coarse_rows.rows == total // (768 * 768)


# ---------------------------------------------------------------------- step 2's η per parameter group
#: two parameter groups (``a.*`` and ``b.*``) with tensors of the same tile shapes in both, so that the
#: bucket-wise path meets a tile group (8 x 8, 1 x 8) and a dense segment with two learning rates
GROUPED_SHAPES = {"a.weight": (16, 24), "a.bias": (48,), "a.norm": (8,),
                  "b.weight": (24, 16), "b.bias": (40,), "b.norm": (12,)}
GROUP_LRS, GROUP_DECAYS = (0.02, 0.05), (0.1, 0.0)
#: a LambdaLR whose ratio between the groups changes at every step
GROUP_LAMBDAS = (lambda step: 1.0 - 0.1 * step, lambda step: 0.6 ** step)
CHUNK, K, BETA, DENSE_BELOW = 8, 5, 0.9, 32


def _dct_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II basis from its definition (the authors build it as ``_dct(eye(n), "ortho")``)."""
    i, j = torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(torch.pi * (2 * j + 1) * i / (2 * n)) * (2.0 / n) ** 0.5
    basis[0] /= 2 ** 0.5
    return basis


class _AuthorsDeMo:
    """The authors' DeMo optimizer (github bloc97/DeMo, ``demo.py``: ``DeMo(torch.optim.SGD).step``) for one
    worker, written out: for every parameter group and its ``lr`` *at this step*, for every parameter
    ``p.mul_(1 − lr·λ)``, ``delta.mul_(β).add_(grad, alpha=lr)``, the DCT of each tile (``TransformDCT``:
    ``(y h) (x w) -> y x h w`` tiles of the largest divisors at most the chunk; a 1-D tensor in rows of
    ``w``), the ``k`` of largest magnitude per tile (``CompressDCT``, ``k`` clamped to the tile), what they
    decode to subtracted from ``delta``, the all-gather (one worker), per coefficient the mean over the
    workers that chose it (``scatter_reduce(..., "mean", include_self=False)``), decoded, its sign as the
    gradient, then SGD's step ``p.add_(sign, alpha=-lr)``. A tensor the package sends dense takes every
    coefficient (``k`` = the tile). ``first_group_lr``: the momentum weighs gradients by the first group's
    ``lr`` instead (the package before it read each parameter's group)."""

    def __init__(self, optimizer: torch.optim.SGD, names: dict[int, str], first_group_lr: bool = False) -> None:
        self.optimizer, self.names, self.first_group_lr = optimizer, names, first_group_lr
        self.delta: dict[str, torch.Tensor] = {}

    @staticmethod
    def _tiles(shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        return largest_divisor_at_most(rows, CHUNK), largest_divisor_at_most(cols, CHUNK)

    def _encode(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """``(tiles, a·b)`` coefficients, tiles in row-major grid order."""
        rows, cols = x.reshape(-1, x.shape[-1]).shape
        tiles = x.reshape(rows // a, a, cols // b, b)
        return torch.einsum("yhxw,bh,dw->yxbd", tiles, _dct_basis(a), _dct_basis(b)).reshape(-1, a * b)

    def _decode(self, coefficients: torch.Tensor, shape: tuple[int, ...], a: int, b: int) -> torch.Tensor:
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        tiles = coefficients.reshape(rows // a, cols // b, a, b)
        return torch.einsum("yxbd,bh,dw->yhxw", tiles, _dct_basis(a), _dct_basis(b)).reshape(shape)

    @torch.no_grad()
    def step(self) -> None:
        first_lr = float(self.optimizer.param_groups[0]["lr"])
        for group, decay in zip(self.optimizer.param_groups, GROUP_DECAYS):
            lr = float(group["lr"])
            for p in group["params"]:
                name = self.names[id(p)]
                p.mul_(1.0 - lr * decay)
                delta = self.delta.setdefault(name, torch.zeros_like(p))
                delta.mul_(BETA).add_(p.grad, alpha=first_lr if self.first_group_lr else lr)
                a, b = self._tiles(tuple(p.shape))
                k = a * b if p.numel() < DENSE_BELOW else min(K, a * b)
                coefficients = self._encode(delta, a, b)
                indices = coefficients.abs().topk(k, dim=-1, sorted=False).indices
                values = coefficients.gather(-1, indices)
                sent = torch.zeros_like(coefficients).scatter_reduce_(-1, indices, values, "mean", include_self=False)
                delta.sub_(self._decode(sent, tuple(p.shape), a, b))
                gathered_indices, gathered_values = [indices], [values]  # the all-gather of one worker
                mean = torch.zeros_like(coefficients).scatter_reduce_(
                    -1, torch.cat(gathered_indices, -1), torch.cat(gathered_values, -1), "mean", include_self=False)
                p.grad = self._decode(mean, tuple(p.shape), a, b).sign_()
        self.optimizer.step()  # SGD with weight_decay=0: p ← p − lr·sign


def _grouped_model(lr_type: str) -> tuple[dict[str, torch.nn.Parameter], torch.optim.SGD,
                                          torch.optim.lr_scheduler.LambdaLR]:
    """Float64 parameters (no tie in a top-k, no sign within rounding of 0), their SGD of two groups and the
    schedule; ``lr_type="tensor"``: each group's ``lr`` a 0-d tensor (changed in place by the scheduler)."""
    generator = torch.Generator().manual_seed(7)
    params = {name: torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
              for name, shape in GROUPED_SHAPES.items()}
    wrap = (lambda lr: torch.tensor(lr, dtype=torch.float64)) if lr_type == "tensor" else float
    groups = [{"params": [p for name, p in params.items() if name.startswith(prefix)], "lr": wrap(lr),
               "weight_decay": decay} for prefix, lr, decay in zip("ab", GROUP_LRS, GROUP_DECAYS)]
    optimizer = torch.optim.SGD(groups, lr=0.0)
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, list(GROUP_LAMBDAS))


def _grouped_gradient(name: str, p: torch.Tensor, step: int) -> torch.Tensor:
    """A pull towards a target that changes every step (so a wrong step changes every later gradient)."""
    generator = torch.Generator().manual_seed(100 * step + list(GROUPED_SHAPES).index(name))
    return p.detach() - torch.randn(p.shape, generator=generator, dtype=p.dtype)


def _run_the_authors_demo(steps: int, first_group_lr: bool = False) -> dict[str, torch.Tensor]:
    params, optimizer, schedule = _grouped_model("float")
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0  # the authors decay the weights themselves (DeMo(weight_decay=...))
    reference = _AuthorsDeMo(optimizer, {id(p): name for name, p in params.items()}, first_group_lr)
    for step in range(steps):
        for name, p in params.items():
            p.grad = _grouped_gradient(name, p, step)
        reference.step()
        schedule.step()
    return {name: p.detach().clone() for name, p in params.items()}


@pytest.mark.parametrize("lr_type", ["float", "tensor"])
@pytest.mark.parametrize("bucket_wise", [False, True], ids=["per-tensor", "bucket-wise"])
def test_each_parameter_takes_its_own_groups_learning_rate_as_the_authors_demo_does(bucket_wise: bool,
                                                                                    lr_type: str) -> None:
    """Two parameter groups whose learning rates change in different ratios (a LambdaLR of one lambda per
    group), 6 steps of one worker: our DeMo bound to the SGD with the parameters' names (what
    ``gradcomp.bind`` and the strategies pass) ends where the authors' DeMo ends, per tensor and bucket-wise
    (a tile group and the dense tensors mixing the two groups' rates), with float and 0-d tensor ``lr``s.
    The momentum weighed by the first group's rate for every parameter (the package before) ends 0.09 away."""
    steps = 6
    expected = _run_the_authors_demo(steps)
    before = _run_the_authors_demo(steps, first_group_lr=True)
    assert max((before[name] - expected[name]).abs().max().item() for name in GROUPED_SHAPES) > 0.05
    params, optimizer, schedule = _grouped_model(lr_type)
    compressor = DeMo(chunk=CHUNK, k=K, decay=BETA)
    compressor.check_optimizer(optimizer, names={id(p): name for name, p in params.items()})
    with accelerator_path() if bucket_wise else contextlib.nullcontext():
        assert (compressor.segment_alignment(torch.device("cpu")) is not None) == bucket_wise
        exchange = SimulatedExchange(compressor, 1, min_compress_numel=DENSE_BELOW)
        for step in range(steps):
            exchange.add_worker(0, [(name, _grouped_gradient(name, p, step).reshape(-1)) for name, p in params.items()],
                                GROUPED_SHAPES)
            aggregate = exchange.finish_step()
            for name, p in params.items():
                p.grad = aggregate[name].view(p.shape).clone()
            optimizer.step()
            schedule.step()
    for name, p in params.items():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_the_learning_rate_of_each_parameter_follows_the_optimizers_bound() -> None:
    """Each name finds its group; a group added later is found; a parameter in no group of the optimizers
    bound with names takes lr=1 with a warning naming it once; without names, several groups warn."""
    import pickle
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1}], lr=0.5)
    compressor = DeMo()
    compressor.check_optimizer(optimizer, names=names)
    assert compressor._learning_rate("0.weight") == 0.1
    unheld = r"parameter '1.bias' is in no parameter group of the optimizers bound \(SGD\): step 2 takes lr=1"
    with pytest.warns(UserWarning, match=unheld):
        assert compressor._learning_rate("1.bias") == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compressor._learning_rate("1.bias") == 1.0  # warned once
    optimizer.add_param_group({"params": model[1].parameters(), "lr": 0.3})
    optimizer.param_groups[0]["lr"] = 0.2
    assert [compressor._learning_rate(name) for name in ("0.bias", "1.weight")] == [0.2, 0.3]
    second = torch.optim.SGD([{"params": [model[1].bias], "lr": 0.7}])  # a second optimizer: it wins its parameter
    compressor.check_optimizer(second, names=names)
    assert [compressor._learning_rate(name) for name in ("0.bias", "1.weight", "1.bias")] == [0.2, 0.3, 0.7]
    assert pickle.loads(pickle.dumps(compressor))._learning_rate("0.bias") == 1.0  # the binding is per process
    with pytest.warns(UserWarning, match="SGD has 2 parameter groups, but no parameter names came with it"):
        DeMo().check_optimizer(optimizer)


def test_bind_and_the_strategies_check_pass_the_parameter_names() -> None:
    """``check_fit_setup`` (the strategies') and the handles' ``check_optimizer`` hand DeMo the names; a
    compressor whose ``check_optimizer`` takes none is called as before."""
    from types import SimpleNamespace

    from lightning_gradcomp.compressors import TopK
    from lightning_gradcomp.lightning.options import check_fit_setup

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                 {"params": model[1].parameters(), "lr": 0.3}])
    compressor = DeMo()
    check_fit_setup(compressor, False, [optimizer], SimpleNamespace(scaler=None), names=names)
    assert [compressor._learning_rate(name) for name in ("0.weight", "1.bias")] == [0.1, 0.3]
    TopK(0.1).check_optimizer(optimizer, names=names)  # every compressor takes the names (most ignore them)
    compressor = DeMo()
    compressor.check_optimizer(optimizer, names=names)
    assert compressor._learning_rate("1.weight") == 0.3


def test_the_simulated_strategy_binds_each_parameter_to_its_group(tmp_path) -> None:
    """The same two groups and schedule in a Lightning run (GradCompSimStrategy of one worker; the loss's
    gradient is the pull of :func:`_grouped_gradient`): the strategy's optimizer check passes the module's
    parameter names, and the parameters end where the authors' DeMo ends."""
    import lightning as L

    from lightning_gradcomp import GradCompSimStrategy

    class Grouped(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            params, _, _ = _grouped_model("float")
            self.a, self.b = torch.nn.Module(), torch.nn.Module()
            for name, p in params.items():
                prefix, _, leaf = name.partition(".")
                getattr(self, prefix).register_parameter(leaf, p)

        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step
            targets = {name: p.detach() - _grouped_gradient(name, p, step) for name, p in self.named_parameters()}
            loss = sum(0.5 * (p - targets[name]).square().sum() for name, p in self.named_parameters())
            return loss + 0 * batch.sum()

        def configure_optimizers(self):
            groups = [{"params": [p for name, p in self.named_parameters() if name.startswith(prefix)], "lr": lr,
                       "weight_decay": decay} for prefix, lr, decay in zip("ab", GROUP_LRS, GROUP_DECAYS)]
            optimizer = torch.optim.SGD(groups, lr=0.0)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, list(GROUP_LAMBDAS))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    steps = 6
    model = Grouped()
    strategy = GradCompSimStrategy(workers=1, compressor=DeMo(chunk=CHUNK, k=K, decay=BETA),
                                   min_compress_numel=DENSE_BELOW, print_summary=False, log_stats=False)
    data = torch.utils.data.DataLoader(torch.zeros(steps, 1, dtype=torch.float64), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, precision="64-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(model, train_dataloaders=data)
    assert trainer.global_step == steps
    expected = _run_the_authors_demo(steps)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def _check_register_binds_each_group(rank: int, world_size: int) -> None:
    """In a gloo process: ``register()``'s handle binds with the model's names, by ``bind`` and at the first
    step of an optimizer it was not given (its ``OptimizerWatch``), and a switched-to DeMo is bound so too."""
    import lightning_gradcomp

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                 {"params": model[1].parameters(), "lr": 0.3}])
    compressor = DeMo(chunk=4, k=2)
    handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=16)
    handle.bind(optimizer)
    assert [compressor._learning_rate(name) for name in ("0.weight", "1.bias")] == [0.1, 0.3]
    switched = DeMo(chunk=4, k=2)
    handle.use_compressor(switched)
    assert [switched._learning_rate(name) for name in ("0.bias", "1.weight")] == [0.1, 0.3]
    handle.close()

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    compressor = DeMo(chunk=4, k=2)
    handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=16)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                 {"params": model[1].parameters(), "lr": 0.3}])
    with pytest.warns(UserWarning, match="no optimizer is bound"):
        ddp(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # the watch binds it, with the names
    assert [compressor._learning_rate(name) for name in ("0.weight", "1.bias")] == [0.1, 0.3]
    handle.close()


def test_register_binds_each_parameter_to_its_group() -> None:
    from tests._processes import run_gloo

    run_gloo(_check_register_binds_each_group, 1)
