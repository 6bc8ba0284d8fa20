"""A real multi-process Fabric run of a sharded model: Lightning's ``ModelParallelStrategy(parallelize_fn=...)``
shards it (FSDP2 inside each replica), ``register_fsdp`` compresses what the replicas exchange (HSDP).

    python fabric_fsdp.py --out /tmp/x --steps 16 --save-at 8

Trains ``--steps`` steps, saving (``fabric.save``) after ``--save-at``; then builds the model again, loads
that checkpoint (``fabric.load`` + ``gradcomp.load_state_dict``) and trains the remaining steps; then trains
the same steps with native HSDP (``fully_shard`` on the 2-D mesh, dense fp32 all-reduce between replicas)
for comparison. With ``--local H`` the replicas train with local updates on their shards instead
(``local_updates(model, optimizer, H, compressor, mesh=mesh)``; the checkpoint's model saved inside
``global_weights()``, ``sync()`` at the end), and no native run follows. Every rank writes ``<out>.rank<R>.pt``: the shards of the runs' final parameters, losses,
figures and the summary.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_gradcomp
from lightning_gradcomp.examples.digits import DigitsDataModule

from _fsdp_digits import DigitsTransformer, local_shards

REPLICAS = 2
mesh: Optional[DeviceMesh] = None  # ("replicate", "shard"), built once the processes have started
native = False  # shard on the whole 2-D mesh instead: FSDP's own HSDP, nothing compressed
local: Optional[int] = None  # --local H: local updates on the shards (local_updates(..., mesh=)) instead
ours = False  # --strategy gradcomp_fsdp: GradCompFabricFSDPStrategy shards, registers, binds, saves and loads


def shard(model: nn.Module, _fabric_mesh: DeviceMesh) -> nn.Module:
    """The ``parallelize_fn``: FSDP2 over the shard dimension of our mesh (Fabric's own mesh is not used)."""
    over = mesh if native else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=over)
    fully_shard(model, mesh=over)
    return model


def build(fabric: Fabric, compressor: Optional[str]) -> tuple[Any, Any, Any]:
    """The model sharded and set up, its optimizer, and the compressed exchange between the replicas
    (``compressor=None``: native HSDP, no exchange of ours; under ``GradCompFabricFSDPStrategy`` the strategy's)."""
    global native
    native = compressor is None
    torch.manual_seed(0)
    model = fabric.setup_module(DigitsTransformer())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if ours:
        return model, optimizer, fabric.strategy.gradcomp
    if native:
        return model, optimizer, None
    if local is not None:
        return model, optimizer, lightning_gradcomp.local_updates(model.module, optimizer, local, compressor, mesh=mesh,
                                                                  min_compress_numel=256)
    gradcomp = lightning_gradcomp.register_fsdp(model.module, mesh, compressor, min_compress_numel=256)
    gradcomp.bind(optimizer)
    return model, optimizer, gradcomp


def batch(images: torch.Tensor, labels: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's 16 examples of ``step`` (a fixed order, so that a resumed run sees the same batches)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(step))[16 * rank:16 * (rank + 1)]
    return images[order], labels[order]


def main() -> None:
    global mesh
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-at", type=int, default=12)
    parser.add_argument("--local", type=int, default=None, help="local updates on the shards every H steps")
    parser.add_argument("--strategy", choices=["model_parallel", "gradcomp_fsdp"], default="model_parallel")
    args = parser.parse_args()
    global local, ours
    local = args.local
    ours = args.strategy == "gradcomp_fsdp"

    world = 4
    if ours:  # one line: the strategy builds the mesh, shards, registers, binds, and saves the exchange state
        strategy = lightning_gradcomp.GradCompFabricFSDPStrategy(
            parallelize_fn=shard, shard_size=world // REPLICAS, compressor=args.compressor, min_compress_numel=256,
            local_updates=local, telemetry=True)
    else:
        strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    mesh = fabric.strategy.device_mesh if ours else \
        init_device_mesh("cpu", (REPLICAS, world // REPLICAS), mesh_dim_names=("replicate", "shard"))
    data = DigitsDataModule()
    data.setup()
    images, labels = data.train_set.tensors
    path = f"{args.out}.ckpt"

    def train(model: Any, optimizer: Any, gradcomp: Any, first: int, save: bool) -> list[dict]:
        steps = []
        for step in range(first, args.steps):
            x, y = batch(images, labels, step, fabric.global_rank)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"loss": loss.item()})
            if ours:
                steps[-1]["metrics"] = fabric.strategy.metrics()  # what fabric.log_dict would log
            if gradcomp is not None:
                stats = gradcomp.step_stats
                steps[-1].update(bytes_sent=stats.bytes_sent, bytes_dense=stats.bytes_dense)
                if local is not None:
                    steps[-1]["synced"] = gradcomp.loop.synced  # this step ended a window
            if save and step + 1 == args.save_at and ours:  # the strategy adds the exchange state itself
                fabric.save(path, {"model": model, "optimizer": optimizer, "step": step + 1})
                if local is not None:  # an evaluation mid-window sees θ_global (model.eval(), no gradients)
                    model.eval()
                    with torch.no_grad():
                        evaluated = model(x)
                        with gradcomp.global_weights():
                            on_global = model(x)
                    model.train()
                    steps[-1]["evaluation_saw_global"] = bool(torch.equal(evaluated, on_global))
            elif save and step + 1 == args.save_at:
                entry = gradcomp.state_dict()  # every rank: a collective
                state = {"model": model, "optimizer": optimizer, "gradcomp": entry, "step": step + 1}
                if local is None:
                    fabric.save(path, state)
                else:
                    with gradcomp.global_weights():  # the checkpoint's model is θ_global
                        fabric.save(path, state)
        if local is not None:
            gradcomp.sync()  # the end: every rank's shards set to θ_global's
        return steps

    model, optimizer, gradcomp = build(fabric, args.compressor)
    steps = train(model, optimizer, gradcomp, 0, save=True)
    result = {"shards": local_shards(model.module), "steps": steps, "hook_step": gradcomp.hook_state.step,
              "syncs": gradcomp.loop.outer.syncs if local is not None else None,
              "totals": gradcomp.totals.state_dict(), "summary": gradcomp.summary(),
              "mesh": mesh.get_coordinate()}
    gradcomp.close()

    model, optimizer, gradcomp = build(fabric, args.compressor)
    if ours:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)  # the exchange state too
    else:
        state = {"model": model, "optimizer": optimizer, "gradcomp": None, "step": 0}
        fabric.load(path, state)
        gradcomp.load_state_dict(state["gradcomp"])
    resumed_steps = train(model, optimizer, gradcomp, state["step"], save=False)
    result.update(resumed_shards=local_shards(model.module), resumed_from=state["step"], resumed_steps=resumed_steps,
                  resumed_totals=gradcomp.totals.state_dict(), resumed_hook_step=gradcomp.hook_state.step)
    gradcomp.close()

    if local is None and not ours:
        model, optimizer, _ = build(fabric, None)
        result.update(native_steps=train(model, optimizer, None, 0, save=False))
    torch.save(result, f"{args.out}.rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
