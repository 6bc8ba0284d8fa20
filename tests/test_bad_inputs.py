"""Every bad input is a ValueError naming the parameter and the allowed values, raised at construction
or before the first step: one row per case, with the expected message fragment in the row. A new option
gets a row here."""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp
from lightning_gradcomp import GradCompHookState, GradCompSimStrategy, GradCompStrategy, LocalUpdates
from lightning_gradcomp.callbacks import AdaptiveCompression, DGCWarmup, GradientNormTrigger
from lightning_gradcomp.compressors import DGC, QSGD, HardThreshold, PowerSGD, RandomK, TopK, get_compressor
from lightning_gradcomp.wiring import ExchangePlan

NAN = float("nan")

CONSTRUCTION = [
    # (case, constructor, expected message fragment)
    ("find_unused_parameters str", lambda: GradCompStrategy(find_unused_parameters="yes"),
     "`find_unused_parameters` must be True or False"),
    ("static_graph str", lambda: GradCompStrategy(static_graph="true"), "`static_graph` must be True or False"),
    ("gradient_as_bucket_view int", lambda: GradCompStrategy(gradient_as_bucket_view=1),
     "`gradient_as_bucket_view` must be True or False"),
    ("bucket_cap_mb str", lambda: GradCompStrategy(bucket_cap_mb="25"), "`bucket_cap_mb` must be a number > 0"),
    ("bucket_cap_mb negative", lambda: GradCompStrategy(bucket_cap_mb=-1), "`bucket_cap_mb` must be a number > 0"),
    ("backend typo", lambda: GradCompStrategy(process_group_backend="glooo"),
     "`process_group_backend` must be None or one of .*gloo.*nccl"),
    ("timeout negative", lambda: GradCompStrategy(timeout=-5),
     "`timeout` must be a datetime.timedelta > 0 or a number of seconds > 0"),
    ("timeout zero timedelta", lambda: GradCompStrategy(timeout=timedelta(0)), "`timeout` must be"),
    ("log_stats str", lambda: GradCompStrategy(log_stats="no"), "`log_stats` must be True or False"),
    ("exchange_thread str", lambda: GradCompStrategy(exchange_thread="off"), "`exchange_thread` must be True or False"),
    ("error_feedback int", lambda: GradCompStrategy(error_feedback=1), "`error_feedback` must be None, True or False"),
    ("error_feedback with DGC", lambda: GradCompStrategy(compressor="dgc", error_feedback=True),
     "`error_feedback` must be None or False with DGC"),
    ("sim log_stats str", lambda: GradCompSimStrategy(log_stats="no"), "`log_stats` must be True or False"),
    ("sim uneven_batches", lambda: GradCompSimStrategy(uneven_batches="drop"),
     "`uneven_batches` must be 'pad', 'split' or 'error'"),
    ("sim workers", lambda: GradCompSimStrategy(workers=0), "`workers` must be an integer >= 1"),
    ("hook compressor name", lambda: GradCompHookState("topkk", {}), "`compressor`: unknown name 'topkk'"),
    ("hook compressor type", lambda: GradCompHookState(3, {}), "`compressor` must be a Compressor instance or one of"),
    ("hook names", lambda: GradCompHookState("topk", ["w"]), "`param_names` must be a dict of id"),
    ("hook min_compress_numel", lambda: GradCompHookState("topk", {}, min_compress_numel=-1),
     "`min_compress_numel` must be an integer >= 0"),
    ("hook seed", lambda: GradCompHookState("topk", {}, seed="1"), "`seed` must be an integer >= 0"),
    ("hook error_feedback", lambda: GradCompHookState("topk", {}, error_feedback="yes"),
     "`error_feedback` must be None, True or False"),
    ("register without a DDP wrapper", lambda: lightning_gradcomp.register(None),
     "`ddp_model` must be a torch.nn.parallel.DistributedDataParallel"),
    ("register_fsdp without a mesh", lambda: lightning_gradcomp.register_fsdp(torch.nn.Linear(2, 2), None),
     "`mesh` must be a torch.distributed.device_mesh.DeviceMesh"),
    ("options compressor name", lambda: lightning_gradcomp.ExchangeOptions("topkk"), "`compressor`: unknown name 'topkk'"),
    ("options min_compress_numel", lambda: lightning_gradcomp.ExchangeOptions(min_compress_numel=-1),
     "`min_compress_numel` must be an integer >= 0"),
    ("options seed", lambda: lightning_gradcomp.ExchangeOptions(seed=1.5), "`seed` must be an integer >= 0"),
    ("options error_feedback with DGC", lambda: lightning_gradcomp.ExchangeOptions("dgc", error_feedback=True),
     "`error_feedback` must be None or False with DGC"),
    ("plan options type", lambda: ExchangePlan("topk"), "`options` must be a lightning_gradcomp.ExchangeOptions"),
    ("plan local_updates type", lambda: ExchangePlan(local_updates=10), "`local_updates` must be None or a LocalUpdates"),
    ("plan fault_tolerance without local updates",
     lambda: ExchangePlan(fault_tolerance=lightning_gradcomp.FaultTolerance("http://127.0.0.1:1")),
     "`fault_tolerance` runs the synchronisations of local updates through torchft"),
    ("plan global_device without local updates", lambda: ExchangePlan(global_device="cpu"),
     "`global_device` places θ_global under local updates"),
    ("plan telemetry str", lambda: ExchangePlan(telemetry="yes"), "`telemetry` must be True or False"),
    ("plan timeout negative", lambda: ExchangePlan(timeout=-1), "`timeout` must be a positive timedelta or number of seconds"),
    ("DGC nesterov str", lambda: DGC(nesterov="no"), "`nesterov` must be True or False"),
    ("DGC scale_clip_by_workers str", lambda: DGC(scale_clip_by_workers="false"),
     "`scale_clip_by_workers` must be True or False"),
    ("DGC momentum", lambda: DGC(momentum=1.0), r"`momentum` must be a number in \[0, 1\)"),
    ("DGC selection", lambda: DGC(selection="approx"), "`selection` must be one of 'blocks', 'sampled', 'exact'"),
    ("Top-k selection", lambda: TopK(selection="approx"), "`selection` must be one of 'blocks', 'sampled', 'exact'"),
    ("TopK density", lambda: TopK(density=2), r"`density` must be a number in \(0, 1\]"),
    ("RandomK shared_indices str", lambda: RandomK(shared_indices="yes"), "`shared_indices` must be True or False"),
    ("QSGD bits", lambda: QSGD(bits=1), r"`bits` must be an integer in \[2, 32\]"),
    ("QSGD levels and bits", lambda: QSGD(levels=16, bits=8), r"`levels` \(16\) and `bits` \(8, i.e. levels=127\) disagree"),
    ("threshold nan", lambda: HardThreshold(threshold=NAN), "`threshold` must be a finite number >= 0"),
    ("PowerSGD rank", lambda: PowerSGD(rank=0), "`rank` must be an integer >= 1"),
    ("PowerSGD warm_start", lambda: PowerSGD(warm_start="yes"), "`warm_start` must be True or False"),
    ("adaptive monitor None", lambda: AdaptiveCompression(monitor=None, levels=[{"bits": 4}, None], thresholds=[0.5]),
     "`monitor` must be the name of a logged metric"),
    ("adaptive thresholds count", lambda: AdaptiveCompression("val_acc", [{"bits": 4}, None], thresholds=[0.5, 0.6]),
     r"`thresholds` must hold len\(levels\) - 1 = 1 values, got 2"),
    ("adaptive thresholds NaN", lambda: AdaptiveCompression("val_acc", [{"bits": 4}, {"bits": 8}, None], [0.5, NAN]),
     "`thresholds` must be finite numbers"),
    ("adaptive thresholds not rising", lambda: AdaptiveCompression("val_acc", [{"bits": 4}, {"bits": 8}, None],
                                                                   [0.8, 0.6]),
     "`thresholds` must be non-decreasing for mode='max'"),
    ("adaptive thresholds not falling", lambda: AdaptiveCompression("val_loss", [{"bits": 4}, {"bits": 8}, None],
                                                                    [0.5, 0.9], mode="min"),
     "`thresholds` must be non-increasing for mode='min'"),
    ("adaptive mode", lambda: AdaptiveCompression("val_acc", [None], [], mode="up"), "`mode` must be 'max' or 'min'"),
    ("adaptive loss_monitor", lambda: AdaptiveCompression("val_acc", [None], [], loss_monitor=""),
     "`loss_monitor` must be None or the name of a logged metric"),
    ("trigger ratio", lambda: GradientNormTrigger({"density": 0.1}, {"density": 0.01}, ratio=NAN),
     "`ratio` must be a number > 0"),
    ("warmup densities empty", lambda: DGCWarmup(epochs=2, densities=[]), "`densities` must be None"),
    ("warmup both lengths", lambda: DGCWarmup(epochs=2, steps=10), "give exactly one of `epochs` or `steps`"),
    ("warmup lr_warmup str", lambda: DGCWarmup(epochs=2, lr_warmup="yes"), "`lr_warmup` must be True or False"),
    ("outer lr NaN", lambda: LocalUpdates(4, functools.partial(torch.optim.SGD, lr=NAN)),
     "`outer_optimizer`: the outer optimizer's lr must be finite and >= 0"),
    ("outer lr negative", lambda: LocalUpdates(4, functools.partial(torch.optim.SGD, lr=-1.0)),
     r"`outer_optimizer`: building the outer optimizer failed: Invalid learning rate: -1.0 \(these are the outer"),
    ("outer momentum 1", lambda: LocalUpdates(4, functools.partial(torch.optim.SGD, lr=0.7, momentum=1.0)),
     r"the outer optimizer's momentum must be finite and in \[0, 1\)"),
    ("outer not an optimizer", lambda: LocalUpdates(4, lambda params: list(params)),
     "`outer_optimizer` must build a torch.optim.Optimizer"),
    ("local optimizers None", lambda: lightning_gradcomp.local_updates(torch.nn.Linear(2, 2), None),
     "`optimizers` must be the inner torch.optim.Optimizer that steps the model, or a non-empty list"),
    ("local optimizers empty", lambda: lightning_gradcomp.local_updates(torch.nn.Linear(2, 2), []),
     "with none, no synchronisation would ever happen"),
]


@pytest.mark.parametrize("case,build,message", CONSTRUCTION, ids=[row[0] for row in CONSTRUCTION])
def test_bad_input_at_construction(case, build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


class _Tiny(L.LightningModule):
    def __init__(self, validate: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Linear(40, 40)
        self.steps = 0
        if not validate:
            self.validation_step = None  # type: ignore[assignment]

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", 0.5)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(strategy, callbacks=(), limit_val_batches=1.0, devices=1, validate=True) -> _Tiny:
    data = DataLoader(TensorDataset(torch.randn(16, 40)), batch_size=8)
    model = _Tiny(validate)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=limit_val_batches, num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(model, data, data if validate else None)
    return model


BEFORE_TRAINING = [
    ("later level invalid", lambda: [AdaptiveCompression("val_acc", [{"density": 0.01}, {"density": 2}], [0.5])],
     1.0, r"level \{'density': 2\} is not valid for TopK: `density` must be a number in \(0, 1\]"),
    ("later level invalid bits", lambda: [AdaptiveCompression("val_acc", [{"density": 0.1}, {"bits": 1}], [0.5])],
     1.0, "a level sets `bits`, which TopK does not have"),
    ("trigger level invalid", lambda: [GradientNormTrigger({"density": 0.1}, {"density": -1})], 1.0,
     r"level \{'density': -1\} is not valid for TopK"),
    ("schedule without validation", lambda: [AdaptiveCompression("val_acc", [{"density": 0.1}, None], [0.5])], 0,
     "AdaptiveCompression decides after each validation epoch .* but validation does not run"),
]


@pytest.mark.parametrize("case,callbacks,limit_val,message", BEFORE_TRAINING, ids=[row[0] for row in BEFORE_TRAINING])
def test_bad_schedule_is_refused_before_the_first_step(case, callbacks, limit_val, message) -> None:
    strategy = GradCompSimStrategy(workers=2, compressor=TopK(0.1), min_compress_numel=0)
    model = _Tiny()
    with pytest.raises(ValueError, match=message):
        data = DataLoader(TensorDataset(torch.randn(16, 40)), batch_size=8)
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=limit_val, num_sanity_val_steps=0, callbacks=callbacks()).fit(model, data, data)
    assert model.steps == 0, "refused before the first step"


def test_simulation_refuses_several_devices() -> None:
    with pytest.raises(ValueError, match="GradCompSimStrategy simulates 2 workers in one process .* devices=2.*"
                                         "use strategy='gradcomp'"):
        _fit(GradCompSimStrategy(workers=2), devices=2)


def test_simulation_pads_an_uneven_last_batch_like_ddp() -> None:
    strategy = GradCompSimStrategy(workers=3, compressor="none")
    data = DataLoader(TensorDataset(torch.randn(10, 40)), batch_size=4)  # batches of 4, 4, 2
    model = _Tiny()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(model, data)
    assert model.steps == 3 * 3, "every batch ran on 3 workers, the uneven ones padded"


@pytest.mark.parametrize("entry,message", [
    ({"version": 2, "world_size": 2, "compressor": "TopK", "ranks": [{}]},
     "compression state has format 2; this version of lightning-gradcomp reads format 1"),
    ({"version": 1, "world_size": 2, "compressor": "TopK"}, "compression state is damaged .*ranks"),
])
def test_a_checkpoint_this_version_cannot_read_is_refused_with_the_reason(entry, message) -> None:
    from lightning_gradcomp.simulation import SimulatedExchange

    strategy = GradCompSimStrategy(workers=2)
    strategy.hook_state = SimulatedExchange(strategy.compressor, 2)
    strategy._pending_checkpoint = (entry, "unused.ckpt")  # (the entry, the checkpoint it came from)
    with pytest.raises(ValueError, match=message):
        strategy._restore_pending()


def test_cli_value_error_is_one_short_message(tmp_path) -> None:
    import os
    from pathlib import Path

    from tests._processes import run_script

    recipe = Path(__file__).parents[1] / "recipes" / "quickstart_digits.yaml"
    code, output = run_script("lightning_gradcomp", ["fit", "--config", str(recipe), "--trainer.devices=1",
                                                     "--trainer.strategy.init_args.compressor.init_args.density=2"],
                              tmp_path, dict(os.environ), timeout=300)
    assert code == 2, output[-2000:]
    assert "`density` must be a number in (0, 1], got 2.0" in output
    assert "Traceback" not in output and len(output.strip().splitlines()) <= 6, output


# ------------------------------------------------------------------ compressor and strategy arguments
@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "0.1", True])
@pytest.mark.parametrize("cls", [TopK, RandomK])
def test_density_outside_unit_interval(cls, density) -> None:
    with pytest.raises(ValueError, match=r"`density` must be a number in \(0, 1\]"):
        cls(density=density)


def test_density_is_checked_when_a_schedule_changes_it() -> None:
    compressor = TopK(0.1)
    with pytest.raises(ValueError, match="`density`"):
        compressor.density = 2.0
    assert compressor.density == 0.1


@pytest.mark.parametrize("levels", [0, -3, 2.5, True])
def test_qsgd_levels_below_one(levels) -> None:
    with pytest.raises(ValueError, match=r"`levels` must be an integer in \[1, "):
        QSGD(levels=levels)


def test_qsgd_bucket_size() -> None:
    with pytest.raises(ValueError, match="`bucket_size` must be an integer >= 1"):
        QSGD(bucket_size=0)


@pytest.mark.parametrize("threshold", [-1e-3, float("nan"), float("inf"), "x"])
def test_negative_threshold(threshold) -> None:
    with pytest.raises(ValueError, match="`threshold` must be a finite number >= 0"):
        HardThreshold(threshold=threshold)


def test_unknown_compressor_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"`compressor`: unknown name 'topkk'; allowed names: .*qsgd.*topk"):
        get_compressor("topkk")
    with pytest.raises(ValueError, match="`compressor`: unknown name"):
        GradCompStrategy(compressor="zip")
    with pytest.raises(ValueError, match="`compressor` must be a Compressor instance or one of"):
        GradCompStrategy(compressor=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ddp_comm_hook": lambda s, b: None}, "`ddp_comm_hook` must be None"),
        ({"ddp_comm_state": object()}, "`ddp_comm_state` must be None"),
        ({"ddp_comm_wrapper": lambda h: h}, "`ddp_comm_wrapper` must be None"),
        ({"model_averaging_period": 4}, "`model_averaging_period` must be None"),
        ({"bucket_cap": 25}, r"unknown DistributedDataParallel argument\(s\) \['bucket_cap'\]; allowed: .*bucket_cap_mb"),
        ({"bucket_cap_mb": 0}, "`bucket_cap_mb` must be a number > 0"),
        ({"error_feedback": "yes"}, "`error_feedback` must be None, True or False"),
        ({"min_compress_numel": -1}, "`min_compress_numel` must be an integer >= 0"),
        ({"seed": 1.5}, "`seed` must be an integer >= 0"),
        ({"start_method": "thread"}, "`start_method` must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
    ],
)
def test_strategy_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GradCompStrategy(**kwargs)


def test_strategy_accepts_every_ddp_argument() -> None:
    strategy = GradCompStrategy(compressor="qsgd", find_unused_parameters=True, static_graph=False,
                                bucket_cap_mb=10, gradient_as_bucket_view=True, process_group_backend="gloo")
    assert isinstance(strategy.compressor, QSGD)
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 10


def test_registered_names_build_the_strategy() -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="gradcomp_spawn", logger=False)
    assert isinstance(trainer.strategy, GradCompStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert isinstance(trainer.strategy.compressor, TopK)


def test_one_options_object_configures_every_strategy() -> None:
    """``ExchangeOptions`` is the keyword list of every entry point (docs/guides/trainer.md, "Options"): its
    ``keywords()`` configure each strategy alike, and each keeps the same validated options."""
    options = lightning_gradcomp.ExchangeOptions("int8", min_compress_numel=4096, seed=3)
    strategies = [GradCompStrategy(**options.keywords()), GradCompSimStrategy(**options.keywords()),
                  lightning_gradcomp.GradCompFabricStrategy(**options.keywords()),
                  lightning_gradcomp.GradCompFSDPStrategy(**options.keywords()),
                  lightning_gradcomp.GradCompFabricFSDPStrategy(**options.keywords())]
    for strategy in strategies:
        assert strategy.options == options, type(strategy).__name__
    assert options.keywords() == lightning_gradcomp.ExchangeOptions(**options.keywords()).keywords()


def test_the_trainer_leaves_the_replica_in_the_model_during_a_training_batch() -> None:
    """Under local updates the Trainer shows θ_global to validation itself; a forward pass in eval mode without
    gradients inside a training batch (a callback's sample, a per-batch metric) sees this rank's replica, as
    ``lightning/local_updates_fit.py`` says: no evaluation hook swaps θ_global in (the plain loops' rule)."""
    from lightning_gradcomp import GradCompStrategy

    class Peeks(L.Callback):
        changed: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            before = pl_module.net.weight.detach().clone()
            pl_module.eval()
            with torch.no_grad():
                pl_module(batch[0])
            pl_module.train()
            self.changed.append(not torch.equal(before, pl_module.net.weight.detach()))

    _Tiny.forward = lambda self, x: self.net(x)  # type: ignore[method-assign]
    environment = dict(os.environ)  # the strategy sets MASTER_PORT, LOCAL_RANK...: later tests' processes must not see them
    try:
        _fit(GradCompStrategy(compressor="none", local_updates=LocalUpdates(4), print_summary=False), [Peeks()],
             validate=False)
    finally:
        del _Tiny.forward
        os.environ.clear()
        os.environ.update(environment)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert Peeks.changed and not any(Peeks.changed), Peeks.changed
