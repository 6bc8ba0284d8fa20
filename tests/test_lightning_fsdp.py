"""GradCompFSDPStrategy (compressed HSDP under the Trainer) and the Fabric route, with real processes on
CPU/gloo: 4 ranks as 2 replicas x 2 shards, each rank forked from the tests' fork server with ``LOCAL_RANK``
set (as torchrun starts them), so no rank pays Lightning's import again."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Callable

import pytest
import torch

from lightning_gradcomp.exchange.checkpoint import gather_parts
from tests._processes import run_job, SCRIPTS

WORLD = 4


def run_ranks(tmp_path: Path, name: str, script: str, *args: str, world: int = WORLD,
              timeout: float = 240) -> tuple[list[dict], str]:
    """Run ``tests/scripts/<script>`` as ``world`` processes of one job (:func:`run_job`); every rank's results
    and their combined output."""
    codes, output = run_job(SCRIPTS / script, ["--out", str(tmp_path / name), *args], tmp_path, world, timeout)
    assert all(code == 0 for code in codes), output[-6000:]
    results = [torch.load(tmp_path / f"{name}.rank{rank}.pt", weights_only=False) for rank in range(world)]
    return results, output


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[list[dict], str]]:
    """Memoised runs of ``train_fsdp.py`` / ``fabric_fsdp.py`` (several tests read one run)."""
    root = tmp_path_factory.mktemp("fsdp")
    cache: dict[tuple[str, ...], tuple[list[dict], str]] = {}

    def run(script: str, name: str, *args: str) -> tuple[list[dict], str]:
        key = (script, name, *args)
        if key not in cache:
            cache[key] = run_ranks(root, name, script, *args)
        return cache[key]

    run.root = root  # type: ignore[attr-defined]
    return run


def _mean_loss(steps: list[dict], part: slice) -> float:
    losses = [step["loss"] for step in steps[part]]
    return sum(losses) / len(losses)


def _replicas_equal(ranks: list[dict], key: str = "shards") -> bool:
    """Ranks with the same shard index in the two replicas (0 and 2, 1 and 3) hold identical shards."""
    shards = [rank[key] for rank in ranks]
    return all(torch.equal(shards[r][name], shards[r + 2][name]) for r in (0, 1) for name in shards[r])


# ---------------------------------------------------------------------- the Trainer, 2 replicas x 2 shards
def _trainer_fit(fsdp_runs) -> tuple[list[dict], str, Path]:
    """Two epochs of Top-k on the transformer sharded by its configure_model, with a checkpoint written at the
    end of the first while the run goes on, and its CSV log."""
    ckpt = fsdp_runs.root / "epoch1.ckpt"
    ranks, output = fsdp_runs("train_fsdp.py", "fit", "--epochs", "2", "--save", str(ckpt),
                              "--csv", str(fsdp_runs.root / "csv"))
    return ranks, output, ckpt


@pytest.mark.multiprocess
def test_trainer_fit_learns_with_identical_replicas_counted_bytes_and_a_summary(fsdp_runs) -> None:
    ranks, output, _ = _trainer_fit(fsdp_runs)
    steps = 2 * 22  # 1348 training images / 4 ranks / batch 16, rounded up, per epoch
    assert [tuple(rank["mesh"]) for rank in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [rank["sampler"] for rank in ranks] == [{"num_replicas": 4, "rank": r} for r in range(4)], \
        "every rank its own share of the data"
    for rank in ranks:
        assert rank["fsdp_modules"] == ["", "model.blocks.0", "model.blocks.1"]
        assert rank["compression_workers"] == 2
        assert rank["global_step"] == rank["hook_step"] == steps and len(rank["steps"]) == steps
        assert rank["hook_calls"] == 3 * steps, "every FSDP group's shard exchanged once per step"
        assert [s["hook_step"] for s in rank["steps"]] == list(range(1, steps + 1))
        assert all(s["bytes_sent"] > 0 and s["bytes_dense"] / s["bytes_sent"] > 8 for s in rank["steps"])
    first = sum(_mean_loss(rank["steps"], slice(0, 8)) for rank in ranks) / WORLD
    last = sum(_mean_loss(rank["steps"], slice(-8, None)) for rank in ranks) / WORLD
    assert first - last > 0.3, (first, last)  # measured: 2.33 -> 1.90
    assert _replicas_equal(ranks), "the two replicas end with identical parameters"
    assert all(torch.equal(ranks[0]["full"][name], rank["full"][name]) for rank in ranks for name in ranks[0]["full"])
    assert output.count("gradcomp summary") == 1 and f"workers, steps           2, {steps}" in output
    (metrics_file,) = (fsdp_runs.root / "csv").rglob("metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("gradcomp/bytes_sent")]
    assert len(logged) == steps // 5 + 1  # steps 0, 5, ..., 40
    assert all(math.isfinite(float(row["gradcomp/compression_ratio"])) for row in logged)


@pytest.mark.multiprocess
def test_trainer_resume_from_the_sharded_checkpoint_continues_bit_for_bit(fsdp_runs) -> None:
    whole, _, ckpt = _trainer_fit(fsdp_runs)
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == WORLD, "Lightning's sharded checkpoint"
    assert torch.load(ckpt / "meta.pt", weights_only=True)["gradcomp"]["parts"] == WORLD
    assert len(list((ckpt / "gradcomp").glob("rank*.pt"))) == WORLD  # each rank its part, in the directory
    entry = gather_parts(ckpt)
    assert entry["world_size"] == WORLD and len(entry["ranks"]) == WORLD and entry["compressor"] == "TopK"
    assert all(rank["step"] == 22 for rank in entry["ranks"])
    resumed, output = fsdp_runs("train_fsdp.py", "resumed", "--epochs", "2", "--resume", str(ckpt))
    assert "Restored all states from the checkpoint" in output
    for a, b in zip(whole, resumed):
        assert b["steps"][0]["global_step"] == 23 and b["hook_step"] == a["hook_step"] == 44
        assert a["residual_norm"] == b["residual_norm"], "each rank's residuals restored"
        assert a["totals"] == b["totals"]
        assert all(torch.equal(a["shards"][name], b["shards"][name]) for name in a["shards"])


@pytest.mark.multiprocess
def test_trainer_auto_wrap_policy_accumulation_validation_and_monitor(fsdp_runs) -> None:
    """``auto_wrap_policy={TransformerEncoderLayer}`` shards the blocks and the LightningModule; with
    ``accumulate_grad_batches=2`` one exchange per optimizer step; CompressionMonitor and DGCWarmup work
    through the ``ExchangeState`` contract; validation runs through the root's FSDP hooks."""
    csv_dir = fsdp_runs.root / "csv-policy"
    ranks, output = fsdp_runs("train_fsdp.py", "policy", "--wrap", "policy", "--epochs", "2", "--accumulate", "2",
                              "--monitor", "--warmup", "--validate", "--csv", str(csv_dir))
    for rank in ranks:
        assert rank["fsdp_modules"] == ["", "model.blocks.0", "model.blocks.1"]
        assert rank["global_step"] == rank["hook_step"] == 22
        assert rank["hook_calls"] == 3 * 22, "no exchange on the accumulating micro-batches"
        assert math.isfinite(rank["val_loss"])
        densities = [step["compressor_density"] for step in rank["steps"]]
        assert densities[0] == 0.25 and densities[-1] == 0.01, densities  # DGCWarmup(steps=4)
    assert _replicas_equal(ranks)
    assert "total compression error" in output and "not recorded" not in output
    (metrics_file,) = csv_dir.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    assert any(row.get("gradcomp/total_error") for row in rows) and any(row.get("val_loss") for row in rows)


# ---------------------------------------------------------------------- Fabric: ModelParallelStrategy + register_fsdp
@pytest.mark.multiprocess
def test_fabric_model_parallel_with_register_fsdp_learns_and_resumes_bit_for_bit(fsdp_runs) -> None:
    ranks, _ = fsdp_runs("fabric_fsdp.py", "fabric")
    for rank in ranks:
        assert rank["hook_step"] == 24 and rank["resumed_from"] == 12 and rank["resumed_hook_step"] == 24
        assert all(s["bytes_dense"] / s["bytes_sent"] > 8 for s in rank["steps"])
        assert all(torch.equal(rank["shards"][name], rank["resumed_shards"][name]) for name in rank["shards"]), \
            "fabric.save / fabric.load + the exchange state: the resumed run ends bit for bit where the whole one did"
        assert rank["totals"] == rank["resumed_totals"]
    assert _replicas_equal(ranks) and _replicas_equal(ranks, "resumed_shards")
    assert "gradcomp summary" in ranks[0]["summary"] and "workers, steps           2, 24" in ranks[0]["summary"]
    topk_first = sum(_mean_loss(rank["steps"], slice(0, 8)) for rank in ranks) / WORLD
    topk_last = sum(_mean_loss(rank["steps"], slice(-8, None)) for rank in ranks) / WORLD
    native_last = sum(_mean_loss(rank["native_steps"], slice(-8, None)) for rank in ranks) / WORLD
    assert topk_first - topk_last > 0.3, (topk_first, topk_last)
    assert abs(topk_last - native_last) < 0.2, (topk_last, native_last)  # measured: see docs/sharded.md


@pytest.mark.multiprocess
def test_the_fabric_sharded_strategy_equals_model_parallel_with_register_fsdp_bit_for_bit(fsdp_runs) -> None:
    """``GradCompFabricFSDPStrategy(parallelize_fn=..., shard_size=2, compressor="topk")``: one line in place of
    ModelParallelStrategy, the mesh, register_fsdp, bind and the exchange state in fabric.save/load by hand;
    the same 24 steps end bit for bit where the hand-wired run does, and its resume from fabric.save too."""
    ours, _ = fsdp_runs("fabric_fsdp.py", "fabric-ours", "--strategy", "gradcomp_fsdp")
    wired, _ = fsdp_runs("fabric_fsdp.py", "fabric")
    for mine, theirs in zip(ours, wired):
        assert mine["mesh"] == theirs["mesh"] and mine["hook_step"] == 24 and mine["resumed_hook_step"] == 24
        for key in ("shards", "resumed_shards"):
            assert all(torch.equal(mine[key][name], theirs[key][name]) for name in theirs[key]), key
        assert [s["bytes_sent"] for s in mine["steps"]] == [s["bytes_sent"] for s in theirs["steps"]]
        counted = ("steps", "buckets", "bytes_sent", "bytes_dense", "elements_sent", "elements_total")
        assert [mine["totals"][key] for key in counted] == [mine["resumed_totals"][key] for key in counted] == \
            [theirs["totals"][key] for key in counted]  # (times and, with telemetry, errors are measured)
    assert "gradcomp summary" in ours[0]["summary"] and "not recorded" not in ours[0]["summary"]
    for rank in ours:  # telemetry=True: Fabric's route to a logger, fabric.log_dict(fabric.strategy.metrics())
        metrics = rank["steps"][-1]["metrics"]
        assert metrics["gradcomp/bytes_sent"] == rank["steps"][-1]["bytes_sent"] and 0 < metrics["gradcomp/relative_error"] < 1


@pytest.mark.multiprocess
def test_fabric_local_updates_on_shards_end_on_theta_global_and_resume_mid_window_bit_for_bit(fsdp_runs) -> None:
    """``GradCompFabricFSDPStrategy(local_updates=5, compressor="int8")``: 24 steps, a ``fabric.save`` at step 12
    (inside a window: the strategy saves the model as θ_global, the replicas in the exchange state), then
    ``sync()``."""
    ranks, _ = fsdp_runs("fabric_fsdp.py", "fabric-local", "--local", "5", "--compressor", "int8",
                         "--strategy", "gradcomp_fsdp")
    for rank in ranks:
        assert rank["syncs"] == 24 // 5 + 1, "4 windows and the final synchronisation of the last 4 steps"
        assert rank["resumed_from"] == 12
        assert all(torch.equal(rank["shards"][name], rank["resumed_shards"][name]) for name in rank["shards"])
        assert [step for step, s in enumerate(rank["steps"], 1) if s["synced"]] == [5, 10, 15, 20]
        assert rank["steps"][11]["evaluation_saw_global"], "model.eval() under no_grad shows θ_global (on the shards)"
    assert _replicas_equal(ranks) and _replicas_equal(ranks, "resumed_shards"), "every rank ends on θ_global"
    first = sum(_mean_loss(rank["steps"], slice(0, 6)) for rank in ranks) / WORLD
    last = sum(_mean_loss(rank["steps"], slice(-6, None)) for rank in ranks) / WORLD
    assert first - last > 0.2, (first, last)


# ---------------------------------------------------------------------- bad options, before training
def test_registered_for_the_trainer_and_every_override_is_marked() -> None:
    import inspect

    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_gradcomp import GradCompFSDPStrategy

    trainer = L.Trainer(strategy="gradcomp_fsdp", accelerator="cpu", devices=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, GradCompFSDPStrategy)
    inherited = {name for base in ModelParallelStrategy.__mro__ if base.__module__.startswith("lightning.")
                 for name in vars(base)}
    unmarked = []
    for name, member in vars(GradCompFSDPStrategy).items():
        if name.startswith("__") or name not in inherited:
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if inspect.isfunction(function) and not getattr(function, "__override__", False):
            unmarked.append(name)
    assert not unmarked, unmarked


def test_registered_for_fabric_with_its_options_checked_and_every_override_marked() -> None:
    """``Fabric(strategy="gradcomp_fsdp")`` is the Fabric twin (it was Lightning's generic "invalid strategy"),
    its options are checked before any process starts, and each method it overrides is marked."""
    import inspect

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_gradcomp import GradCompFabricFSDPStrategy

    assert isinstance(Fabric(strategy="gradcomp_fsdp", accelerator="cpu", devices=2).strategy,
                      GradCompFabricFSDPStrategy)
    for kwargs, message in [({"hierarchy": "node"}, "`hierarchy='node'`"), ({"find_unused_parameters": True},
                            "unknown option"), ({"shard_size": 0}, "`shard_size` must be"),
                            ({"parallelize_fn": len, "auto_wrap_policy": {"torch.nn.Linear"}}, "one of the two"),
                            ({"global_device": "cpu"}, "global_device"), ({"compressor": "nope"}, "nope")]:
        with pytest.raises(ValueError, match=message):
            GradCompFabricFSDPStrategy(**kwargs)
    inherited = {name for base in ModelParallelStrategy.__mro__ if base.__module__.startswith("lightning.")
                 for name in vars(base)}
    unmarked = [name for name, member in vars(GradCompFabricFSDPStrategy).items()
                if not name.startswith("__") and name in inherited and inspect.isfunction(
                    getattr(member.fget if isinstance(member, property) else member, "__func__",
                            member.fget if isinstance(member, property) else member))
                and not getattr(member.fget if isinstance(member, property) else getattr(member, "__func__", member),
                                "__override__", False)]
    assert not unmarked, unmarked


def test_lightning_model_parallel_setup_still_does_what_ours_repeats() -> None:
    """GradCompFSDPStrategy.setup repeats ModelParallelStrategy.setup's steps (it must shard by policy first and
    cannot call it: it refuses a module without configure_model). A Lightning upgrade that changes those steps
    fails here, naming the place to look."""
    import inspect

    from lightning.pytorch.strategies import ModelParallelStrategy

    steps = ["self.accelerator.setup(trainer)", "_materialize_distributed_module(self.model, self.root_device)",
             "self.precision_plugin.convert_module(self.model)", "self.model_to_device()", "self.barrier()",
             "self.setup_optimizers(trainer)", "self.setup_precision_plugin()",
             "_optimizers_to_device(self.optimizers, self.root_device)"]
    source = inspect.getsource(ModelParallelStrategy.setup)
    positions = [source.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), (
        "lightning.pytorch.strategies.ModelParallelStrategy.setup changed; bring GradCompFSDPStrategy.setup "
        f"(lightning_gradcomp/lightning/fsdp_strategy.py) in line with it: {dict(zip(steps, positions))}")
    assert "self.lightning_module._device_mesh = self._device_mesh" in inspect.getsource(
        ModelParallelStrategy.setup_environment), "how the LightningModule sees the mesh changed"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"local_updates": "10"}, "`local_updates` must be None"),
    ({"global_device": "cpu"}, "`global_device` places θ_global under local updates"),
    ({"local_updates": 10, "global_device": "cuda"}, "`global_device` must be None"),
    ({"hierarchy": "node"}, "`hierarchy='node'`: the mesh is the hierarchy"),
    ({"exchange_thread": True}, "`exchange_thread=True`: the exchange runs in FSDP2's all-reduce hook"),
    ({"data_parallel_size": 2}, "allowed: shard_size="),
    ({"tensor_parallel_size": 2}, "tensor parallelism is not combined"),
    ({"bucket_cap_mb": 25}, r"unknown option\(s\) \['bucket_cap_mb'\]; allowed: compressor, "),
    ({"shard_size": 0}, "`shard_size` must be None .* or an integer >= 1"),
    ({"shard_size": "2"}, "`shard_size` must be None"),
    ({"shard_size": True}, "`shard_size` must be None"),
    ({"auto_wrap_policy": "torch.nn.Linear"}, "`auto_wrap_policy` must be a set, list or tuple"),
    ({"auto_wrap_policy": set()}, "`auto_wrap_policy` must be a set, list or tuple"),
    ({"auto_wrap_policy": {int}}, "got the entry <class 'int'>"),
    ({"auto_wrap_policy": {"no.such.Module"}}, "cannot import 'no.such.Module'"),
    ({"mp_policy": object()}, "apply to the modules auto_wrap_policy shards"),
    ({"reshard_after_forward": False}, "apply to the modules auto_wrap_policy shards"),
    ({"auto_wrap_policy": {"torch.nn.Linear"}, "mp_policy": "bf16"}, "`mp_policy` must be None or a"),
    ({"auto_wrap_policy": {"torch.nn.Linear"}, "reshard_after_forward": 1}, "`reshard_after_forward` must be None"),
    ({"compressor": "nope"}, "nope"),
    ({"error_feedback": "yes"}, "`error_feedback` must be None, True or False"),
    ({"min_compress_numel": -1}, "`min_compress_numel` must be an integer >= 0"),
    ({"log_stats": "no"}, "`log_stats` must be True or False"),
    ({"print_summary": 1}, "`print_summary` must be True or False"),
    ({"save_distributed_checkpoint": "yes"}, "`save_distributed_checkpoint` must be True or False"),
    ({"timeout": -1}, "`timeout` must be a datetime.timedelta > 0"),
    ({"process_group_backend": "tcp"}, "`process_group_backend` must be None or one of"),
])
def test_bad_options_are_refused_at_construction(kwargs: dict, message: str) -> None:
    from lightning_gradcomp import GradCompFSDPStrategy

    with pytest.raises(ValueError, match=message):
        GradCompFSDPStrategy(**kwargs)


def test_good_options_are_kept() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_gradcomp import GradCompFSDPStrategy
    from lightning_gradcomp.lightning.sharding import check_world_divides

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    strategy = GradCompFSDPStrategy(compressor="int8", shard_size=8, local_updates=None, hierarchy=None,
                                    auto_wrap_policy=["torch.nn.TransformerEncoderLayer", torch.nn.Linear],
                                    mp_policy=policy, reshard_after_forward=2)
    assert strategy.auto_wrap_policy == (torch.nn.Linear, torch.nn.TransformerEncoderLayer)
    assert strategy.fully_shard_kwargs == {"reshard_after_forward": 2, "mp_policy": policy}
    assert strategy.shard_size == 8 and type(strategy.compressor).__name__ == "Int8AllReduce"
    assert check_world_divides(8, 4, False) == 2
    with pytest.raises(ValueError, match=r"world size 6 is not a multiple of shard_size=4; allowed: shard_size in "
                                         r"\[1, 2, 3, 6\]"):
        check_world_divides(6, 4, False)


def check_refused_when_fit_starts(rank: int, world_size: int) -> None:
    """In one gloo process: what only ``fit`` can see is refused before the first step."""
    import lightning as L
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from lightning_gradcomp import GradCompFSDPStrategy

    class Unsharded(L.LightningModule):
        def __init__(self, shard: str = "", optimizer: str = "sgd") -> None:
            super().__init__()
            self.shard, self.optimizer = shard, optimizer
            self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def configure_model(self) -> None:
            if self.shard == "body":
                fully_shard(self.body, mesh=self.device_mesh["shard"])
            elif self.shard == "all":
                fully_shard(self, mesh=self.device_mesh["shard"])

        def training_step(self, batch, batch_idx):
            return self.head(self.body(batch[0])).sum()

        def configure_optimizers(self):
            return (torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.SGD)(self.parameters(), lr=0.1)

    class NoConfigureModel(Unsharded):
        configure_model = L.LightningModule.configure_model

    def fit(module: L.LightningModule, **options) -> GradCompFSDPStrategy:
        strategy = GradCompFSDPStrategy(**options)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
        trainer.fit(module, data)
        return strategy

    with pytest.warns(UserWarning, match=r"the mesh has one replica \(mesh\['replicate'\] of size 1\): nothing crosses"):
        strategy = fit(Unsharded("all"), min_compress_numel=0, print_summary=False)  # a 1 x 1 mesh
    assert strategy.device_mesh.shape == (1, 1) and strategy.compression_workers == 1
    assert strategy.hook_state.step == 2 and strategy.step_stats.bytes_sent > 0

    with pytest.raises(ValueError, match=r"world size 1 is not a multiple of shard_size=2; allowed: shard_size in "
                                         r"\[1\]"):
        fit(Unsharded("all"), shard_size=2)
    with pytest.raises(ValueError, match="shards the model in one of two ways"):
        fit(NoConfigureModel())
    with pytest.raises(ValueError, match=r"the trainable parameters head.weight, head.bias are not sharded"):
        fit(Unsharded("body"))
    with pytest.raises(ValueError, match="DeMo"):
        fit(Unsharded("all", "adamw"), compressor="demo")


@pytest.mark.multiprocess
def test_what_only_fit_can_see_is_refused_before_the_first_step() -> None:
    from tests._processes import run_gloo

    run_gloo(check_refused_when_fit_starts, 1)


# ---------------------------------------------------------------------- local updates on the shards (Trainer)
def _local_fit(fsdp_runs) -> tuple[list[dict], str, Path]:
    """Two epochs (44 steps) of DiLoCo H = 5 with int8 outer gradients on the sharded transformer, validated at
    every epoch's end, a checkpoint at the end of the first (step 22: in the middle of a window); with
    CompressionMonitor and a CSV log (the resumed run, without them, must still match bit for bit)."""
    ckpt = fsdp_runs.root / "local-epoch1.ckpt"
    ranks, output = fsdp_runs("train_fsdp.py", "local", "--epochs", "2", "--local-updates", "5", "--compressor",
                              "int8", "--save", str(ckpt), "--validate", "--monitor", "--csv",
                              str(fsdp_runs.root / "csv-local"))
    return ranks, output, ckpt


@pytest.mark.multiprocess
def test_trainer_local_updates_on_shards_learn_and_end_on_theta_global(fsdp_runs) -> None:
    ranks, output, _ = _local_fit(fsdp_runs)
    steps = 2 * 22
    for rank in ranks:
        assert rank["optimizer_steps"] == rank["global_step"] == steps
        assert rank["syncs"] == steps // 5 + 1, "8 windows, then fit's final synchronisation of the last 4 steps"
        sent = [s for s in rank["steps"] if s["bytes_sent"] > 0]
        assert len(sent) == steps // 5, "nothing crosses between replicas but at a synchronisation"
        assert all(3.0 < s["bytes_dense"] / s["bytes_sent"] < 4.1 for s in sent), "int8 (small shards dense)"
        assert math.isfinite(rank["val_loss"])
        # what each rank holds of θ_global and its outer momentum is its shard: half the model
        assert sum(g.numel() for g in rank["global_shards"]) == sum(p.numel() for p in rank["shards"].values())
    first = sum(_mean_loss(rank["steps"], slice(0, 8)) for rank in ranks) / WORLD
    last = sum(_mean_loss(rank["steps"], slice(-8, None)) for rank in ranks) / WORLD
    assert first - last > 0.2, (first, last)
    assert all(torch.equal(ranks[0]["full"][name], rank["full"][name]) for rank in ranks for name in ranks[0]["full"]), \
        "every rank ends on θ_global"
    assert output.count("gradcomp summary") == 1
    # CompressionMonitor and the strategy log at each synchronisation only (nothing crosses between them)
    (metrics_file,) = (fsdp_runs.root / "csv-local").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    logged = sorted({int(row["step"]) for row in rows if row.get("gradcomp/outer_grad_norm")})
    monitored = sorted({int(row["step"]) for row in rows if row.get("gradcomp/comm_ms_est")})
    assert len(logged) == steps // 5 and monitored == logged, (logged, monitored)


@pytest.mark.multiprocess
def test_trainer_local_updates_checkpoint_holds_theta_global_and_resumes_mid_window_bit_for_bit(fsdp_runs) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole, _, ckpt = _local_fit(fsdp_runs)
    converted = fsdp_runs.root / "local-epoch1.pt"
    dcp_to_torch_save(ckpt, converted)
    model_state = torch.load(converted, weights_only=False)["state_dict"]
    for name, value in model_state.items():  # θ_global at step 22, whole: the two shards' rows
        rows = [whole[rank]["saved_global"][name] for rank in (0, 1)]
        assert torch.equal(value, torch.cat(rows)), name
        assert all(torch.equal(whole[r]["saved_global"][name], whole[r + 2]["saved_global"][name]) for r in (0, 1))
    entry = gather_parts(ckpt)
    assert entry["layout"] == "local-hsdp:replicate=2,shard=2" and len(entry["ranks"]) == WORLD
    resumed, output = fsdp_runs("train_fsdp.py", "local-resumed", "--epochs", "2", "--local-updates", "5",
                                "--compressor", "int8", "--resume", str(ckpt), "--validate")
    assert "Restored all states from the checkpoint" in output
    for a, b in zip(whole, resumed):
        assert b["steps"][0]["global_step"] == 23 and b["optimizer_steps"] == a["optimizer_steps"]
        assert all(torch.equal(a["shards"][name], b["shards"][name]) for name in a["shards"]), "bit for bit"
        assert all(torch.equal(x, y) for x, y in zip(a["global_shards"], b["global_shards"]))
