"""A nanoGPT-shaped training script (karpathy/nanoGPT ``train.py``) with compressed communication.

Run it as nanoGPT is run::

    torchrun --standalone --nproc-per-node 2 examples/nanogpt_train.py --mode register --compressor int8
    torchrun --standalone --nproc-per-node 2 examples/nanogpt_train.py --mode local --sync-every 50
    torchrun --standalone --nproc-per-node 2 examples/nanogpt_train.py --init-from resume   # continue

It keeps nanoGPT's shape on purpose, since that is how third-party loops are written: gradient
accumulation through ``require_backward_grad_sync``, an optional ``GradScaler``, gradient clipping,
evaluation and checkpoints on rank 0 only, resume from ``ckpt.pt``. The lines that differ from
nanoGPT are marked ``# gradcomp``:

- ``--mode register``: the model is wrapped in DDP as before, and ``lightning_gradcomp.register(model,
  compressor)`` compresses its gradients.
- ``--mode local``: local updates (DiLoCo): the bare model, no DDP, ``lightning_gradcomp.local_updates``;
  the inner optimizer's ``step()`` counts the iterations, evaluation and the saved model are ``θ_global``
  (``with handle.global_weights():``), and ``handle.sync()`` ends the run on ``θ_global``.
- the checkpoint's ``"gradcomp"`` entry (every rank's residuals, and with local updates every rank's
  replica and inner-optimizer state) is gathered on every rank before rank 0 saves: ``state_dict()`` is a
  collective.

The data is this repository's README (bytes), so that it runs offline; batches are drawn from a
generator seeded by (iteration, rank, micro-step), so that a resumed run continues exactly.
"""

from __future__ import annotations

import argparse
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_gradcomp

DATA = Path(__file__).resolve().parents[1] / "README.md"


# ------------------------------------------------------------------ the model (nanoGPT's, smaller)
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, block_size: int = 32, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["register", "local"], default="register")
    parser.add_argument("--compressor", default="int8")
    parser.add_argument("--sync-every", type=int, default=3, help="local updates: H")
    parser.add_argument("--out-dir", default="out")
    parser.add_argument("--init-from", choices=["scratch", "resume"], default="scratch")
    parser.add_argument("--max-iters", type=int, default=12)
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="also keep each checkpoint as ckpt-<iteration>.pt (resume one with --resume-from)")
    parser.add_argument("--resume-from", default="ckpt.pt", help="with --init-from resume: the file in --out-dir")
    parser.add_argument("--eval-interval", type=int, default=4)
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--result", default=None, help="write this rank's final weights to RESULT.rank<r>.pt")
    args = parser.parse_args()

    # -------------------------------------------------------------- nanoGPT's DDP set-up
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if torch.cuda.is_available() else "cpu"
        master_process = ddp_rank == 0
        assert args.gradient_accumulation_steps % ddp_world_size == 0
        gradient_accumulation_steps = args.gradient_accumulation_steps // ddp_world_size
    else:
        ddp_rank, ddp_world_size, device, master_process = 0, 1, "cpu", True
        gradient_accumulation_steps = args.gradient_accumulation_steps
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337)

    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    splits = {"train": data[:split], "val": data[split:]}

    def get_batch(name: str, iteration: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed = (name == "val") + 2 * (micro_step + 64 * (ddp_rank + 64 * (iteration + 1024)))
        generator = torch.Generator().manual_seed(seed)
        source = splits[name]
        ix = torch.randint(len(source) - model_args["block_size"] - 1, (args.batch_size,), generator=generator)
        x = torch.stack([source[i:i + model_args["block_size"]] for i in ix])
        y = torch.stack([source[i + 1:i + 1 + model_args["block_size"]] for i in ix])
        return x.to(device), y.to(device)

    # -------------------------------------------------------------- the model, the optimizer, resume
    model_args = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    iter_num, checkpoint = 0, None
    model = GPT(**model_args)
    if args.init_from == "resume":
        checkpoint = torch.load(os.path.join(args.out_dir, args.resume_from), map_location=device, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        iter_num = checkpoint["iter_num"]
    model.to(device)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=False)  # nanoGPT: enabled for float16 only
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    handle = None
    if ddp and args.mode == "register":
        model = DDP(model)
        handle = lightning_gradcomp.register(model, args.compressor)  # gradcomp
    elif ddp:  # gradcomp: local updates train the bare model; no DDP
        handle = lightning_gradcomp.local_updates(model, optimizer, sync_every=args.sync_every,
                                                  compressor=args.compressor)
    if handle is not None and checkpoint is not None and "gradcomp" in checkpoint:
        handle.load_state_dict(checkpoint["gradcomp"])  # gradcomp: every rank's residuals (and replicas)
    raw_model = model.module if ddp and args.mode == "register" else model

    def global_model():  # gradcomp: θ_global under local updates (no communication), else the model
        return handle.global_weights() if args.mode == "local" and handle is not None else nullcontext()

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for name in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                x, y = get_batch(name, -1 - k, 0)
                losses[k] = model(x, y)[1].item()
            out[name] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        warmup = 2
        if it < warmup:
            return args.learning_rate * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / max(1, args.max_iters - warmup)
        return args.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0)))

    # -------------------------------------------------------------- the training loop (nanoGPT's)
    x, y = get_batch("train", iter_num, 0)
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            entry = handle.state_dict() if handle is not None else None  # gradcomp: every rank, before rank 0 saves
            if master_process:
                with global_model():
                    losses = estimate_loss()
                    print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                          flush=True)
                    if iter_num > 0:
                        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                      "model_args": model_args, "iter_num": iter_num, "gradcomp": entry}
                        torch.save(checkpoint, ckpt_path)
                        if args.keep_checkpoints:
                            torch.save(checkpoint, os.path.join(args.out_dir, f"ckpt-{iter_num}.pt"))
        for micro_step in range(gradient_accumulation_steps):
            if ddp and args.mode == "register":
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(x, y)
            loss = loss / gradient_accumulation_steps
            x, y = get_batch("train", iter_num, micro_step + 1)
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        x, y = get_batch("train", iter_num, 0)
        if iter_num > args.max_iters:
            break

    if handle is not None and args.mode == "local":
        handle.sync()  # gradcomp: the last window merged; every rank ends on θ_global
    if args.result:
        torch.save({"params": {k: v.detach().cpu().clone() for k, v in raw_model.state_dict().items()},
                    "iter_num": iter_num}, f"{args.result}.rank{ddp_rank}.pt")
    if handle is not None:
        summary = handle.summary()  # gradcomp: a collective (figures averaged over the ranks)
        if master_process:
            print(summary, flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
