"""Pre-train LitGPT's ``GPT`` from Lightning Fabric with compressed communication: a loop of the shape
LitGPT's ``pretrain`` runs (Fabric launched by the script, LitGPT's model, initialisation and chunked loss,
AdamW, gradient clipping, evaluation and ``fabric.save`` every few steps, resume with ``fabric.load``),
with gradcomp's Fabric strategies in place of LitGPT's::

    python examples/litgpt_pretrain.py --mode ddp --devices 2 --compressor int8
    python examples/litgpt_pretrain.py --mode hsdp --devices 4 --shard-size 2 --compressor int8
    python examples/litgpt_pretrain.py --mode diloco --devices 2 --sync-every 8
    python examples/litgpt_pretrain.py --mode sparseloco --devices 2 --sync-every 8
    python examples/litgpt_pretrain.py --mode diloco --devices 2 --resume out/litgpt/step-000010.ckpt

(``pip install litgpt``; LitGPT pins ``jsonargparse<=4.41``, under which gradcomp's LightningCLI recipes do
not parse: install it with ``pip install --no-deps litgpt`` and its other requirements, as ``.ci/run`` does,
if you also use the recipes.) What a LitGPT user changes, marked ``# gradcomp`` below:

- **compressed DDP** (1 line): ``strategy="ddp"`` becomes ``GradCompFabricStrategy(compressor="int8")``.
- **compressed HSDP** (1 line): LitGPT's FSDP1 ``FSDPStrategy(auto_wrap_policy={Block},
  sharding_strategy="HYBRID_SHARD")`` becomes ``GradCompFabricFSDPStrategy(auto_wrap_policy={Block},
  shard_size=..., compressor="int8")``: FSDP2 shards each block inside a replica, the replicas exchange
  compressed gradients.
- **DiLoCo, SparseLoCo** (2 lines): ``GradCompFabricStrategy(compressor=..., local_updates=H)``, and
  ``fabric.strategy.gradcomp.sync()`` after the loop, so that every rank ends on ``θ_global``.

Nothing else: the strategy binds the exchange to the optimizer, ``fabric.save``/``fabric.load`` carry its
state (residuals, replicas, outer state: the resumed run continues bit for bit), and an evaluation
(``model.eval()`` under ``torch.no_grad()``) sees ``θ_global`` under local updates, not this rank's replica.

The data are the bytes of text files (``--data``: a folder, by default this repository's ``docs``;
vocabulary 256), so that it runs offline; each step's batches are drawn from a generator seeded by (step,
rank), so that a resumed run sees the batches the uninterrupted one saw. ``--report PATH`` writes each
rank's losses, figures and parameters to ``PATH.rank<R>.pt`` (the tests read them).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from litgpt import Config
from litgpt.model import GPT, Block
from litgpt.pretrain import initialize_weights
from litgpt.utils import chunked_cross_entropy

from lightning_gradcomp import GradCompFabricFSDPStrategy, GradCompFabricStrategy, LocalUpdates

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODES = ("ddp", "hsdp", "diloco", "sparseloco")


def make_strategy(args: argparse.Namespace) -> Any:
    """The one strategy line per mode (LitGPT's own: ``"ddp"``, or FSDP1 hybrid-shard for sharded models)."""
    if args.mode == "ddp":  # gradcomp: was strategy="ddp"
        return GradCompFabricStrategy(compressor=args.compressor)
    if args.mode == "hsdp":  # gradcomp: was FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD")
        return GradCompFabricFSDPStrategy(auto_wrap_policy={Block}, shard_size=args.shard_size, compressor=args.compressor)
    if args.mode == "diloco":  # gradcomp: DiLoCo (Douillard et al. 2023): inner AdamW, outer Nesterov SGD
        return GradCompFabricStrategy(compressor=args.compressor, local_updates=args.sync_every)
    # gradcomp: SparseLoCo (Sarfi et al. 2025): Top-k 2-bit outer gradients, plain outer SGD at lr 1
    return GradCompFabricStrategy(compressor="sparseloco", local_updates=LocalUpdates(
        args.sync_every, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0)))


def read_tokens(folder: Path) -> torch.Tensor:
    """Every text file's bytes under ``folder`` (sorted by path), one long sequence of tokens in [0, 256)."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".md", ".txt", ".rst", ".py") and p.is_file())
    if not files:
        raise SystemExit(f"--data {folder}: no .md, .txt, .rst or .py file under it")
    return torch.frombuffer(bytearray(b"\n".join(p.read_bytes() for p in files)), dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, step: int, rank: int, size: int, length: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` windows of ``length`` + 1 tokens from the training (first 90%) or validation part,
    drawn by a generator seeded by (step, rank, split)."""
    cut = int(len(tokens) * 0.9)
    part = tokens[:cut] if split == "train" else tokens[cut:]
    seed = (step * 1009 + rank) * 2 + (split == "val")
    starts = torch.randint(0, len(part) - length - 1, (size,), generator=torch.Generator().manual_seed(seed))
    windows = torch.stack([part[s:s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def validate(fabric: L.Fabric, model: Any, tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """The validation loss averaged over ranks (under local updates: ``θ_global``'s, by the eval rule)."""
    model.eval()
    losses = []
    for index in range(args.eval_batches):
        x, y = batch(tokens, index, fabric.global_rank, args.micro_batch, args.block_size, "val")
        x, y = fabric.to_device(x), fabric.to_device(y)
        losses.append(chunked_cross_entropy(model(x), y))
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean"))


def build(fabric: L.Fabric, args: argparse.Namespace) -> tuple[Any, Any]:
    """LitGPT's model with its GPT-NeoX initialisation (the same on every rank), set up, and AdamW."""
    fabric.seed_everything(args.seed)
    config = Config(name="gradcomp-tiny", block_size=args.block_size, vocab_size=256, padded_vocab_size=256,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, rotary_percentage=0.25,
                    parallel_residual=True)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    return model, fabric.setup_optimizers(optimizer)


def train(fabric: L.Fabric, args: argparse.Namespace, tokens: torch.Tensor, resume: Optional[Path]) -> dict:
    """Train from step 0 (or ``resume``'s step) to ``--steps``; the run's figures."""
    model, optimizer = build(fabric, args)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)  # the exchange's state too
    out = Path(args.out_dir)
    losses: list[float] = []
    validations: list[tuple[int, float]] = []
    local = args.mode in ("diloco", "sparseloco")
    started = time.perf_counter()
    for step in range(state["step"], args.steps):
        x, y = batch(tokens, step, fabric.global_rank, args.micro_batch, args.block_size, "train")
        x, y = fabric.to_device(x), fabric.to_device(y)
        loss = chunked_cross_entropy(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        losses.append(loss.item())
        if state["step"] % args.eval_every == 0:
            validations.append((state["step"], validate(fabric, model, tokens, args)))
            fabric.print(f"step {state['step']}: loss {losses[-1]:.3f}, val {validations[-1][1]:.3f}, "
                         f"{(time.perf_counter() - started) / len(losses) * 1e3:.0f} ms/step")
        if state["step"] % args.save_every == 0:
            fabric.save(out / f"step-{state['step']:06d}.ckpt", state)
    gradcomp = fabric.strategy.gradcomp
    # (for the tests: what an evaluation pass sees here, inside a window when --steps is not a multiple of H)
    evaluation_view = _evaluation_view(model, gradcomp, x) if args.report and local else None
    if local:
        gradcomp.sync()  # gradcomp: the last window merged; every rank's model is θ_global
    summary = gradcomp.summary()  # optional: bytes sent against DDP's, the synchronisations
    fabric.print(summary)
    report = {"losses": losses, "validations": validations, "summary": summary, "from_step": state["step"] - len(losses),
              "totals": gradcomp.totals.state_dict(), "params": _local_params(model)}
    report["evaluation_view"] = evaluation_view
    return report


def _local_params(model: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters (its shards under HSDP), on the host."""
    return {name: getattr(p, "to_local", lambda p=p: p)().detach().cpu().clone() for name, p in model.named_parameters()}


def _evaluation_view(model: Any, gradcomp: Any, x: torch.Tensor) -> dict[str, bool]:
    """For the tests, mid-window: whether an evaluation pass (eval mode, no gradients) equals the pass inside
    ``global_weights()`` (``θ_global``) and whether it equals this rank's replica (a training-mode pass)."""
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
        with gradcomp.global_weights():
            on_global = model(x)
    model.train()
    with torch.no_grad():
        on_replica = model(x)
    return {"equals_global": torch.equal(evaluated, on_global), "equals_replica": torch.equal(evaluated, on_replica)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="ddp")
    parser.add_argument("--compressor", default=None, help="default: int8 (ddp, hsdp), none (diloco)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--shard-size", type=int, default=2, help="hsdp: ranks per replica")
    parser.add_argument("--sync-every", type=int, default=8, help="diloco, sparseloco: inner steps per window")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as LitGPT does")
    parser.add_argument("--data", type=Path, default=DOCS)
    parser.add_argument("--out-dir", default="out/litgpt")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--report", default=None, help="write each rank's figures to REPORT.rank<R>.pt")
    args = parser.parse_args()
    if args.compressor is None:
        args.compressor = "none" if args.mode == "diloco" else "int8"
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                      strategy=make_strategy(args))
    fabric.launch()
    report = train(fabric, args, read_tokens(args.data), args.resume)
    if args.report:
        torch.save(report, f"{args.report}.rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
