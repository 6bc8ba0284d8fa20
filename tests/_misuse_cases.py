"""The cases of the misuse probe (issue 46, item 7; run by tests/misuse_probe.py and tests/test_misuse_probe.py).

Each case misuses one API (a bad value, a setting that differs between ranks, a call in the wrong place or
order, a second exchange on one model, ...) or uses it legitimately, and says what should happen:

* ``@refused(name, area, phrases)``: an exception, on every rank in ``refusing`` (default: all), whose
  message holds every phrase (a regular expression, case-insensitive): one naming the parameter or the
  setting, one saying what to do or which values are allowed. No exception is ``silent``; an exception
  without the phrases is ``vague``. A case may return a text saying what it saw when nothing was refused.
* ``@legit(name, area)``: accepted, and the case checks the result itself (:func:`check`, which raises
  :class:`SilentlyWrong`: the use ran, wrongly). ``refusal_ok`` phrases let a clear refusal count too (a
  use the package may either support or refuse).

Single-process cases take no arguments and run in a process with a gloo group of one (DDP, FSDP2 and the
Trainer need one); multi-process cases (``world=2`` or ``4``) take ``(rank, world_size)`` and run in that
many processes of one gloo group. Every case builds its own models. A case that may hang, or leave the
ranks' collectives out of step, is ``isolated`` (a job of its own, killed after ``timeout`` seconds).

The package is imported inside the cases, and ``requires`` names what a case needs, so that the probe runs
against older checkouts of the package too (a missing name: ``n/a``).
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

#: seconds a bounded wait gets in the cases of a rank that never joins (``GRADCOMP_WAIT_TIMEOUT``)
WAIT = 5
WAIT_ENV = {"GRADCOMP_WAIT_TIMEOUT": str(WAIT)}


class SilentlyWrong(AssertionError):
    """A use ran without an error and its result is wrong."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SilentlyWrong(what)


@dataclass(frozen=True)
class Case:
    name: str
    area: str
    fn: Callable[..., Any]
    expect: str  # "refused" | "legit"
    phrases: tuple[str, ...] = ()
    world: int = 1
    refusing: Optional[tuple[int, ...]] = None
    isolated: bool = False
    timeout: float = 40.0
    env: dict[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    refusal_ok: tuple[str, ...] = ()


CASES: list[Case] = []
BY_NAME: dict[str, Case] = {}


def _add(case: Case) -> Callable[..., Any]:
    assert case.name not in BY_NAME, case.name
    CASES.append(case)
    BY_NAME[case.name] = case
    return case.fn


def refused(name: str, area: str, *phrases: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    return lambda fn: _add(Case(name, area, fn, "refused", tuple(phrases), **options))


def legit(name: str, area: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    options["refusal_ok"] = tuple(options.get("refusal_ok", ()))
    return lambda fn: _add(Case(name, area, fn, "legit", **options))


def _exists(dotted: str) -> bool:
    module, _, attribute = dotted.rpartition(":") if ":" in dotted else (dotted, "", "")
    try:
        value = importlib.import_module(module)
        for part in filter(None, attribute.split(".")):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return False
    except Exception:  # noqa: BLE001 - there, but broken: the case runs and shows the error
        return True
    return True


def run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Run ``case`` on this rank: ``status`` ok / raised / check_failed / na, the exception's type and message,
    the seconds, the package's warnings."""
    missing = [name for name in case.requires if not _exists(name)]
    if missing:
        return {"status": "na", "message": f"the package under test has no {', '.join(missing)}"}
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            said = case.fn(rank, world) if case.world > 1 else case.fn()
            record = {"status": "ok", "message": str(said or "")}
        except SilentlyWrong as error:
            record = {"status": "check_failed", "message": str(error)}
        except BaseException as error:  # noqa: BLE001 - what the user would see
            record = {"status": "raised", "type": type(error).__name__, "message": str(error) or repr(error)}
    record["seconds"] = round(time.perf_counter() - began, 3)
    record["warnings"] = [str(w.message)[:300] for w in caught if "gradcomp" in str(w.message).lower()][:3]
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(name, None)
    gc.collect()
    return record


def preload() -> None:
    """Import what the cases use, once, before the ranks are forked (each would import it again)."""
    for module in ("torch.distributed.fsdp", "torch.distributed.device_mesh", "lightning", "lightning.pytorch",
                   "lightning.fabric", "lightning_gradcomp", "lightning_gradcomp.lightning.strategy",
                   "lightning_gradcomp.lightning.fsdp_strategy", "lightning_gradcomp.lightning.fabric",
                   "lightning_gradcomp.lightning.simulation", "lightning_gradcomp.simulation", "torchft"):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - an older checkout, or torchft missing: the cases say n/a
            pass


# ---------------------------------------------------------------------------------------------- helpers


def lg():  # noqa: ANN201
    import lightning_gradcomp

    return lightning_gradcomp


def _mlp(seed: int = 0, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))


class Net(nn.Module):
    """Two blocks and a head (FSDP2 shards each block, then the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 48)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(48, 48), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batch(step: int, rank: int = 0, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 32, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int = 0, call: Any = None,
           after: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = nn.functional.cross_entropy((call or model)(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after is not None:
            after(step)
    return losses


def _ddp(model: Optional[nn.Module] = None) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(model if model is not None else _mlp())


def _sgd(model: nn.Module, lr: float = 0.1, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, **kwargs)


def _mesh(shape: Optional[tuple[int, int]] = None, names: tuple[str, str] = ("replicate", "shard")) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape or (dist.get_world_size(), 1), mesh_dim_names=names)


def _shard(model: Net, mesh: Any, blocks: bool = True, root: bool = True, **kwargs: Any) -> Net:
    from torch.distributed.fsdp import fully_shard

    if blocks:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
    if root:
        fully_shard(model, mesh=mesh, **kwargs)
    return model


def _sharded(seed: int = 0, **kwargs: Any) -> tuple[Net, Any]:
    mesh = _mesh()
    return _shard(_net(seed), mesh["shard"], **kwargs), mesh


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _close(handle: Any) -> None:
    if handle is not None and hasattr(handle, "close"):
        handle.close()


def _moved(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    after = _full(model)
    return any(not torch.equal(before[name], after[name]) for name in before)


def _same_on_every_rank(model: nn.Module) -> bool:
    """Whether every rank holds the same parameters (bit for bit)."""
    for name, value in _full(model).items():
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value.contiguous())
        if not all(torch.equal(other, gathered[0]) for other in gathered):
            return False
    return True


#: the settings-mismatch refusal, as it names a setting: the setting, every rank's value, what to do
def _mismatch(setting: str) -> tuple[str, ...]:
    return (rf"`?{setting}`?", r"on rank 0", r"on rank 1", r"every rank must pass the same")


REGISTER = "lightning_gradcomp:register"
REGISTER_FSDP = "lightning_gradcomp:register_fsdp"
LOCAL = "lightning_gradcomp:local_updates"
FT = "lightning_gradcomp:FaultTolerance"


# ================================================================================================ compressors


@refused("TopK density 0", "compressors", r"`density`", r"\(0, 1\]")
def _() -> None:
    lg().TopK(density=0)


@refused("TopK density as text", "compressors", r"`density`", r"\(0, 1\]")
def _() -> None:
    lg().TopK(density="0.01")


@refused("QSGD levels 0", "compressors", r"`levels`", r"\[1, ")
def _() -> None:
    lg().QSGD(levels=0)


@refused("QSGD bits 40", "compressors", r"`bits`", r"\[2, 32\]")
def _() -> None:
    lg().QSGD(bits=40)


@refused("DeMo chunk 0", "compressors", r"`chunk`", r">= ?\d|integer")
def _() -> None:
    lg().DeMo(chunk=0)


@refused("DeMo decay 1", "compressors", r"`decay`", r"\[0, 1\)")
def _() -> None:
    lg().DeMo(decay=1.0)


@refused("DeMo value_dtype fp16", "compressors", r"`value_dtype`", r"'float16'")
def _() -> None:
    lg().DeMo(value_dtype="fp16")


@refused("SparseLoCo k above chunk", "compressors", r"`k`", r"at most `chunk`|<=")
def _() -> None:
    lg().SparseLoCo(chunk=64, k=128)


@refused("SparseLoCo bits 16", "compressors", r"`bits`", r"\[1, 8\]|allowed|None")
def _() -> None:
    lg().SparseLoCo(bits=16)


@refused("unknown compressor name", "compressors", r"unknown name 'topk1'", r"allowed names: .*topk")
def _() -> None:
    from lightning_gradcomp.compressors import get_compressor

    get_compressor("topk1")


@refused("compressor class instead of instance", "compressors", r"`compressor`", r"instance|TopK\(\)")
def _() -> None:
    from lightning_gradcomp.compressors import get_compressor

    get_compressor(lg().TopK)


@refused("FP8 format e5m3", "compressors", r"`format`", r"e4m3")
def _() -> None:
    lg().FP8AllReduce(format="e5m3")


@refused("SignSGD scale max", "compressors", r"`scale`", r"'mean'")
def _() -> None:
    lg().SignSGD(scale="max")


@refused("Int8 block_size 0", "compressors", r"`block_size`", r">= ?1|integer")
def _() -> None:
    lg().Int8AllReduce(block_size=0)


@refused("DGC momentum 1.5", "compressors", r"`momentum`", r"\[0, 1\)")
def _() -> None:
    lg().DGC(momentum=1.5)


@legit("TopK keeps the k largest", "compressors", requires=("lightning_gradcomp.simulation:SimulatedExchange",))
def _() -> None:
    from lightning_gradcomp.simulation import SimulatedExchange

    grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    exchange = SimulatedExchange(lg().TopK(density=1 / 16, selection="exact"), workers=1, error_feedback=False,
                                 min_compress_numel=0)
    exchange.add_worker(0, [("w", grad)])
    out = exchange.finish_step()["w"].reshape(-1)
    k = grad.numel() // 16
    chosen = out.nonzero().flatten()
    check(chosen.numel() == k, f"{chosen.numel()} values kept, expected {k}")
    expected = grad.reshape(-1).abs().topk(k).indices
    check(set(chosen.tolist()) == set(expected.tolist()) and torch.equal(out[chosen], grad.reshape(-1)[chosen]),
          "the values kept are not the k largest")


# ================================================================================================ register()


@refused("register a bare model", "register", r"`ddp_model`", r"DistributedDataParallel\(model\)", requires=(REGISTER,))
def _() -> None:
    lg().register(_mlp(), "topk")


@refused("register twice on one DDP model", "register", r"communication hook|second|already",
         r"use_compressor|close\(\)", requires=(REGISTER,))
def _() -> None:
    ddp = _ddp()
    lg().register(ddp, "topk")
    lg().register(ddp, "qsgd")


@refused("register min_compress_numel -1", "register", r"`min_compress_numel`", r">= 0", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk", min_compress_numel=-1)


@refused("register timeout 0", "register", r"`timeout`", r"positive|> 0", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk", timeout=0)


@refused("register exchange_thread as text", "register", r"`exchange_thread`", r"True or False", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk", exchange_thread="yes")


@refused("register unknown compressor", "register", r"unknown name 'topkk'", r"allowed names", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topkk")


@refused("register DeMo, Adam steps", "register", r"DeMo", r"allowed: torch.optim.SGD", requires=(REGISTER,))
def _() -> str:
    ddp = _ddp()
    lg().register(ddp, lg().DeMo(chunk=8, k=4), min_compress_numel=0)
    _train(ddp.module, torch.optim.Adam(ddp.parameters(), lr=1e-3), 2, call=ddp)
    return "two Adam steps after DeMo's sign"


@refused("register DGC, SGD momentum steps", "register", r"momentum", r"allowed|momentum=0|no momentum",
         requires=(REGISTER,))
def _() -> str:
    ddp = _ddp()
    lg().register(ddp, "dgc", min_compress_numel=0)
    _train(ddp.module, _sgd(ddp, momentum=0.9), 2, call=ddp)
    return "DGC's momentum correction under SGD momentum"


@refused("register a sharded model", "register", r"register_fsdp", r"fully_shard", requires=(REGISTER,))
def _() -> None:
    model, _ = _sharded()
    lg().register(model, "topk")


@refused("bind DeMo to another model's optimizer", "register", r"optimizer", r"this model|its parameters|the model's",
         requires=(REGISTER,))
def _() -> str:
    ddp = _ddp()
    handle = lg().register(ddp, lg().DeMo(chunk=8, k=4), min_compress_numel=0)
    other = _mlp(1)
    handle.bind(torch.optim.SGD(other.parameters(), lr=0.5))  # DeMo reads this lr, not the one stepping the model
    _train(ddp.module, _sgd(ddp, lr=0.01), 2, call=ddp)
    return "DeMo weighed its momentum by the other model's lr (0.5), the model steps at 0.01"


@legit("register none equals plain SGD", "register", requires=(REGISTER,))
def _() -> None:
    ddp = _ddp()
    handle = lg().register(ddp, "none")
    plain = _mlp()
    _train(ddp.module, _sgd(ddp), 3, call=ddp)
    _train(plain, _sgd(plain), 3)
    for (name, a), b in zip(ddp.module.named_parameters(), plain.parameters()):
        check(torch.allclose(a, b, atol=1e-6), f"{name} differs from plain SGD")
    check(handle.step_stats.bytes_sent > 0, "no bytes counted")
    handle.close()


def _two_groups(first: str) -> dict[str, torch.Tensor]:
    """DeMo over a model of two independent layers in two parameter groups (listed ``first`` first), layer b's
    learning rate changed after the first step; the layers' values after three steps."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16)})

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m["a"](x) + self.m["b"](x.flip(1))

    ddp = _ddp(Both())
    handle = lg().register(ddp, lg().DeMo(chunk=4, k=2), min_compress_numel=0)
    groups = {"a": {"params": list(model["a"].parameters()), "lr": 1.0},
              "b": {"params": list(model["b"].parameters()), "lr": 0.01}}
    optimizer = torch.optim.SGD([groups[first], groups["b" if first == "a" else "a"]], lr=0.1)
    handle.bind(optimizer)
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(8, 16, generator=generator)
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        groups["b"]["lr"] = 0.5  # a warm-up of layer b only
    handle.close()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@legit("DeMo with per-group learning rates", "register", requires=(REGISTER,),
       refusal_ok=(r"param(eter)? group", r"learning rate|lr"))
def _() -> None:
    one, other = _two_groups("a"), _two_groups("b")
    differ = [name for name in one if not torch.equal(one[name], other[name])]
    check(not differ, f"the order of the optimizer's parameter groups changed DeMo's result ({', '.join(differ)}): "
                      "each parameter's momentum was weighed by the first group's lr, not its own")


# ================================================================================================ register_fsdp()


@refused("register_fsdp an unsharded model", "register_fsdp", r"fully_shard", r"mesh\['shard'\]",
         requires=(REGISTER_FSDP,))
def _() -> None:
    lg().register_fsdp(_net(), _mesh(), "topk")


@refused("register_fsdp a 1-D mesh", "register_fsdp", r"`mesh`", r"mesh_dim_names", requires=(REGISTER_FSDP,))
def _() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    lg().register_fsdp(_shard(_net(), mesh), mesh, "topk")


@refused("register_fsdp swapped mesh dimensions", "register_fsdp", r"`mesh`", r"\('replicate', 'shard'\)",
         requires=(REGISTER_FSDP,))
def _() -> None:
    mesh = _mesh(names=("shard", "replicate"))
    lg().register_fsdp(_shard(_net(), mesh["shard"]), mesh, "topk")


@refused("register_fsdp mesh None", "register_fsdp", r"`mesh`", r"DeviceMesh", requires=(REGISTER_FSDP,))
def _() -> None:
    model, _ = _sharded()
    lg().register_fsdp(model, None, "topk")


@refused("register_fsdp a parameter outside fully_shard", "register_fsdp", r"head\.weight", r"fully_shard",
         requires=(REGISTER_FSDP,))
def _() -> None:
    model, mesh = _sharded(root=False)
    lg().register_fsdp(model, mesh, "topk")


@refused("register_fsdp native HSDP", "register_fsdp", r"2-D mesh|native HSDP", r"mesh\['shard'\]",
         requires=(REGISTER_FSDP,))
def _() -> None:
    mesh = _mesh()
    lg().register_fsdp(_shard(_net(), mesh), mesh, "topk")


@refused("register_fsdp a gradient divide factor", "register_fsdp", r"divide factor", r"leave it unset|unset",
         requires=(REGISTER_FSDP,))
def _() -> None:
    model, mesh = _sharded()
    model.set_gradient_divide_factor(2.0)
    lg().register_fsdp(model, mesh, "topk")


@refused("register_fsdp then set_requires_all_reduce(False)", "register_fsdp", r"set_requires_all_reduce",
         r"set_requires_gradient_sync", requires=(REGISTER_FSDP,))
def _() -> str:
    model, mesh = _sharded()
    lg().register_fsdp(model, mesh, "topk", min_compress_numel=0)
    model.set_requires_all_reduce(False)
    _train(model, _sgd(model), 1)
    return "trained with the all-reduce switched off"


@refused("register_fsdp twice", "register_fsdp", r"register_fsdp\(\)", r"close\(\)", requires=(REGISTER_FSDP,))
def _() -> None:
    model, mesh = _sharded()
    lg().register_fsdp(model, mesh, "topk")
    lg().register_fsdp(model, mesh, "int8")


@refused("register_fsdp unknown compressor", "register_fsdp", r"unknown name 'nope'", r"allowed names",
         requires=(REGISTER_FSDP,))
def _() -> None:
    model, mesh = _sharded()
    lg().register_fsdp(model, mesh, "nope")


@refused("register_fsdp DeMo, AdamW steps", "register_fsdp", r"DeMo", r"allowed: torch.optim.SGD",
         requires=(REGISTER_FSDP,))
def _() -> str:
    model, mesh = _sharded()
    lg().register_fsdp(model, mesh, lg().DeMo(chunk=8, k=4), min_compress_numel=0)
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 2)
    return "AdamW stepped DeMo's signs"


@refused("register_fsdp, optimizer made before fully_shard", "register_fsdp", r"optimizer",
         r"fully_shard|after sharding|sharded parameters", requires=(REGISTER_FSDP,))
def _() -> str:
    model = _net()
    optimizer = _sgd(model)  # holds the parameters fully_shard replaces
    mesh = _mesh()
    _shard(model, mesh["shard"])
    lg().register_fsdp(model, mesh, "topk", min_compress_numel=0)
    before = _full(model)
    _train(model, optimizer, 2)
    return "the model's parameters never moved" if not _moved(before, model) else "trained"


@legit("register_fsdp, then model.to('cpu')", "register_fsdp", requires=(REGISTER_FSDP,),
       refusal_ok=(r"\.to\(|device", r"before|fully_shard|register_fsdp"))
def _() -> None:
    results = []
    for move in (False, True):
        model, mesh = _sharded()
        handle = lg().register_fsdp(model, mesh, "none", min_compress_numel=0)
        if move:
            model.to("cpu")
        optimizer = _sgd(model)
        _train(model, optimizer, 3)
        results.append(_full(model))
        handle.close()
    differ = [name for name in results[0] if not torch.equal(results[0][name], results[1][name])]
    check(not differ, f"after model.to('cpu') training ends elsewhere: {', '.join(differ[:3])}")


# ================================================================================================ local_updates()


def _local(model: Optional[nn.Module] = None, *args: Any, **kwargs: Any) -> Any:
    model = model if model is not None else _mlp()
    optimizer = kwargs.pop("optimizer", None) or _sgd(model)
    return lg().local_updates(model, optimizer, *args, **kwargs)


@refused("local_updates sync_every 0", "local_updates", r"`sync_every`", r">= 1", requires=(LOCAL,))
def _() -> None:
    _local(None, 0)


@refused("local_updates sync_every as text", "local_updates", r"`sync_every`", r"integer", requires=(LOCAL,))
def _() -> None:
    _local(None, "10")


@refused("local_updates 3 fragments, H 4", "local_updates", r"`fragments`|`sync_every`", r"multiple",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 4, fragments=3)


@refused("local_updates delay H", "local_updates", r"`delay`", r"\[0, \d\]|<= ?\d|less than", requires=(LOCAL,))
def _() -> None:
    _local(None, 4, delay=4)


@refused("local_updates alpha 2", "local_updates", r"`alpha`", r"\[0, 1\]", requires=(LOCAL,))
def _() -> None:
    _local(None, 4, alpha=2.0)


@refused("local_updates overlap middle", "local_updates", r"`overlap`", r"'after'.*'before'", requires=(LOCAL,))
def _() -> None:
    _local(None, 4, overlap="middle")


@refused("local_updates outer lr NaN", "local_updates", r"`outer_optimizer`", r"finite and >= 0", requires=(LOCAL,))
def _() -> str:
    handle = _local(None, 1, outer_optimizer=functools.partial(torch.optim.SGD, lr=float("nan")))
    return f"synchronised: {handle.sync()}"


@refused("local_updates outer lr negative", "local_updates", r"`outer_optimizer`", r"learning rate|lr",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 1, outer_optimizer=functools.partial(torch.optim.SGD, lr=-0.7))


@refused("local_updates empty optimizer list", "local_updates", r"`optimizers`", r"non-empty", requires=(LOCAL,))
def _() -> None:
    lg().local_updates(_mlp(), [], 4)


@refused("local_updates optimizer None", "local_updates", r"`optimizers`", r"torch.optim.Optimizer", requires=(LOCAL,))
def _() -> None:
    lg().local_updates(_mlp(), None, 4)


@refused("local_updates twice on one model", "local_updates", r"local_updates\(\)", r"close\(\)", requires=(LOCAL,))
def _() -> None:
    model = _mlp()
    optimizer = _sgd(model)
    lg().local_updates(model, optimizer, 4)
    lg().local_updates(model, optimizer, 4, "int8")


@refused("register after local_updates", "local_updates", r"local_updates\(\)", r"close\(\)",
         requires=(LOCAL, REGISTER))
def _() -> None:
    model = _mlp()
    lg().local_updates(model, _sgd(model), 4)
    lg().register(_ddp(model), "topk")


@refused("local_updates, then model.double()", "local_updates", r"dtype|float64|double", r"local_updates|before|cast",
         requires=(LOCAL,))
def _() -> str:
    model = _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 2, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0))
    model.double()
    for step in range(4):
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x.double()), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    handle.sync()
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return f"trained and synchronised; the parameters are {dtypes}"


@refused("local_updates with another model's optimizer", "local_updates", r"optimizer", r"parameters|this model",
         requires=(LOCAL,))
def _() -> str:
    model, other = _mlp(), _mlp(1)
    handle = lg().local_updates(model, _sgd(other), 2)
    before = _full(model)
    _train(model, _sgd(other), 2)
    handle.sync()
    return "the model never moved" if not _moved(before, model) else "trained"


@refused("local_updates global_device gpu", "local_updates", r"`global_device`", r"'cpu'|None", requires=(LOCAL,))
def _() -> None:
    _local(None, 4, global_device="gpu")


@refused("local_updates unknown compressor", "local_updates", r"unknown name 'int9'", r"allowed names",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 4, "int9")


@refused("local_updates fragment naming no module", "local_updates", r"fragment", r"'nothing'|no module|not a module",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 4, fragments=[["0", "nothing"], ["2"]])


@refused("local_updates fragments missing a parameter", "local_updates", r"fragment", r"exactly one|not in any|2\.",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 4, fragments=[["0"]])


@refused("local_updates fault_tolerance as text", "local_updates", r"`fault_tolerance`", r"FaultTolerance\(",
         requires=(LOCAL,))
def _() -> None:
    _local(None, 4, fault_tolerance="yes")


@refused("local_updates sharded model without mesh", "local_updates", r"mesh", r"init_device_mesh|'replicate', 'shard'",
         requires=(LOCAL,))
def _() -> None:
    model, _ = _sharded()
    _local(model, 4)


@refused("local_updates mesh for an unsharded model", "local_updates", r"fully_shard|sharded",
         r"mesh\['shard'\]|mesh=None",
         requires=(LOCAL,))
def _() -> None:
    _local(_net(), 4, mesh=_mesh())


@refused("local_updates(mesh), optimizer made before fully_shard", "local_updates", r"optimizer",
         r"fully_shard|after sharding|sharded parameters", requires=(LOCAL,))
def _() -> str:
    model = _net()
    optimizer = _sgd(model)
    mesh = _mesh()
    _shard(model, mesh["shard"])
    handle = lg().local_updates(model, optimizer, 2, mesh=mesh)
    before = _full(model)
    _train(model, optimizer, 4)
    handle.sync()
    return "the model's parameters never moved" if not _moved(before, model) else "trained"


@refused("local_updates loop calls the DDP wrapper", "local_updates", r"DistributedDataParallel|DDP",
         r"bare model|call the model", requires=(LOCAL,))
def _() -> str:
    model = _mlp()
    ddp = _ddp(model)
    lg().local_updates(model, _sgd(model), 4)
    _train(model, _sgd(model), 2, call=ddp)
    return "every gradient all-reduced under local updates"


@legit("local_updates H 2 outer SGD lr 1 equals plain SGD", "local_updates", requires=(LOCAL,))
def _() -> None:
    model, plain = _mlp(), _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 2, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0))
    _train(model, optimizer, 4)
    handle.sync()
    _train(plain, _sgd(plain), 4)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        check(torch.allclose(a, b, atol=1e-6), f"{name} differs from plain SGD (one worker, outer SGD at lr 1)")
    handle.close()


# ================================================================================================ FaultTolerance


@refused("FaultTolerance timeout 0", "fault_tolerance", r"`FaultTolerance.timeout`|`timeout`", r"> 0", requires=(FT,))
def _() -> None:
    lg().FaultTolerance(lighthouse="http://127.0.0.1:1", timeout=0)


@refused("FaultTolerance address without scheme", "fault_tolerance", r"lighthouse", r"http://host:port",
         requires=(FT,))
def _() -> None:
    lg().FaultTolerance(lighthouse="127.0.0.1:29510")


@refused("FaultTolerance without an address", "fault_tolerance", r"lighthouse", r"TORCHFT_LIGHTHOUSE",
         requires=(FT,))
def _() -> None:
    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    lg().FaultTolerance()


@refused("FaultTolerance with a mesh", "fault_tolerance", r"fault_tolerance", r"mesh=None", requires=(FT, LOCAL))
def _() -> None:
    model, mesh = _sharded()
    _local(model, 4, mesh=mesh, fault_tolerance=lg().FaultTolerance(lighthouse="http://127.0.0.1:1"))


@refused("FaultTolerance unreachable lighthouse", "fault_tolerance", r"http://127\.0\.0\.1:\d+",
         r"torchft_lighthouse|running", requires=(FT, LOCAL, "torchft"), isolated=True, timeout=20)
def _() -> None:
    from tests.misuse_probe import _free_port

    ft = lg().FaultTolerance(lighthouse=f"http://127.0.0.1:{_free_port()}", connect_timeout=1, quorum_timeout=2,
                              timeout=2)
    _local(None, 1, fault_tolerance=ft).sync()


@refused("FaultTolerance min_replicas above the groups", "fault_tolerance", r"quorum", r"min_replicas|replica groups",
         requires=(FT, LOCAL, "torchft"), isolated=True, timeout=20)
def _() -> str:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    try:
        ft = lg().FaultTolerance(lighthouse=lighthouse.address(), connect_timeout=2, quorum_timeout=3, timeout=3)
        model = _mlp()
        optimizer = _sgd(model)
        handle = lg().local_updates(model, optimizer, 1, fault_tolerance=ft)
        _train(model, optimizer, 2)
        return f"trained alone: {handle.optimizer_steps} steps"
    finally:
        lighthouse.shutdown()


# ================================================================================================ Lightning Trainer


class _Module:  # built lazily: lightning is imported by the cases, not at import
    @staticmethod
    def make(optimizer: str = "sgd", configure_model: bool = False) -> Any:
        import lightning as L

        class Tiny(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
                self.steps = 0

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.steps += 1
                x, y = batch
                return nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                if optimizer == "adamw":
                    return torch.optim.AdamW(self.parameters(), lr=1e-3)
                return torch.optim.SGD(self.parameters(), lr=0.1)

        if not configure_model:
            return Tiny()

        class Sharded(Tiny):
            def configure_model(self) -> None:
                from torch.distributed.fsdp import FSDPModule, fully_shard

                if not isinstance(self, FSDPModule):
                    fully_shard(self, mesh=self.device_mesh["shard"])

        return Sharded()


def _data(n: int = 32) -> Any:
    x, y = _batch(0, n=n)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(strategy: Any, module: Any = None, devices: int = 1, **options: Any) -> Any:
    import lightning as L

    module = module if module is not None else _Module.make()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=options.pop("max_steps", 4),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **options)
    trainer.fit(module, _data())
    return module


def _strategy(name: str) -> Any:
    return getattr(lg(), name)


STRATEGY = "lightning_gradcomp:GradCompStrategy"
FSDP_STRATEGY = "lightning_gradcomp:GradCompFSDPStrategy"
FABRIC_STRATEGY = "lightning_gradcomp:GradCompFabricStrategy"
SIM_STRATEGY = "lightning_gradcomp:GradCompSimStrategy"


@refused("GradCompStrategy unknown compressor", "trainer", r"unknown name 'zip'", r"allowed names",
         requires=(STRATEGY,))
def _() -> None:
    _strategy("GradCompStrategy")(compressor="zip")


@refused("GradCompStrategy local_updates as text", "trainer", r"`local_updates`", r"LocalUpdates\(|int H",
         requires=(STRATEGY,))
def _() -> None:
    _strategy("GradCompStrategy")(local_updates="10")


@refused("GradCompStrategy misspelt DDP argument", "trainer", r"bucket_cap", r"allowed: .*bucket_cap_mb",
         requires=(STRATEGY,))
def _() -> None:
    _strategy("GradCompStrategy")(bucket_cap=25)


@legit("GradCompStrategy(local_updates=2, global_device='cpu')", "trainer", requires=(STRATEGY,),
       refusal_ok=(r"`?global_device`?",
                   r"GradCompFSDPStrategy|local_updates\(\)|GradCompStrategy does not|"
                   r"not (yet )?(supported|an option)"))
def _() -> None:
    strategy = _strategy("GradCompStrategy")(compressor="none", local_updates=2, global_device="cpu")
    module = _fit(strategy, max_steps=4)
    check(module.steps == 4, f"{module.steps} training steps, expected 4")


@refused("Trainer gradcomp with an fp16 loss scale", "trainer", r"16-mixed", r"bf16", requires=(STRATEGY,))
def _() -> str:
    from lightning.pytorch.plugins.precision import MixedPrecision

    # on a CPU Lightning turns precision="16-mixed" into bf16; the plugin keeps fp16's GradScaler
    module = _fit("gradcomp", plugins=[MixedPrecision("16-mixed", "cpu")])
    return f"{module.steps} steps under a loss scale with error feedback"


@refused("Trainer DeMo with AdamW", "trainer", r"DeMo", r"allowed: torch.optim.SGD", requires=(STRATEGY,))
def _() -> str:
    module = _fit(_strategy("GradCompStrategy")(compressor="demo"), _Module.make("adamw"))
    return f"{module.steps} AdamW steps on DeMo's signs"


@refused("Trainer DeMo with gradient_clip_val", "trainer", r"gradient_clip_val", r"allowed: gradient_clip_val=None",
         requires=(STRATEGY,))
def _() -> None:
    _fit(_strategy("GradCompStrategy")(compressor="demo"), gradient_clip_val=1.0)


@refused("GradCompFSDPStrategy shard_size 2 in a world of 1", "trainer", r"shard_size", r"allowed: shard_size in",
         requires=(FSDP_STRATEGY,))
def _() -> None:
    _fit(_strategy("GradCompFSDPStrategy")(shard_size=2), _Module.make(configure_model=True))


@refused("GradCompFSDPStrategy exchange_thread", "trainer", r"`exchange_thread", r"all-reduce hook|allowed|None",
         requires=(FSDP_STRATEGY,))
def _() -> None:
    _strategy("GradCompFSDPStrategy")(exchange_thread=True)


@refused("gradcomp_fsdp without configure_model", "trainer", r"configure_model|auto_wrap_policy",
         r"shards the model in one of two ways|auto_wrap_policy=", requires=(FSDP_STRATEGY,))
def _() -> None:
    _fit("gradcomp_fsdp", _Module.make())


@legit("GradCompFSDPStrategy local updates on a 1 x 1 mesh", "trainer", requires=(FSDP_STRATEGY,))
def _() -> None:
    strategy = _strategy("GradCompFSDPStrategy")(compressor="none", local_updates=2, print_summary=False)
    module = _fit(strategy, _Module.make(configure_model=True), max_steps=4)
    check(module.steps == 4, f"{module.steps} steps, expected 4")


# ================================================================================================ Fabric


def _fabric(strategy: Any, devices: int = 1) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    return fabric


@legit("Fabric strategy gradcomp_fsdp", "fabric", requires=(FSDP_STRATEGY,),
       refusal_ok=(r"gradcomp_fsdp", r"ModelParallelStrategy|register_fsdp"))
def _() -> None:
    fabric = _fabric("gradcomp_fsdp")
    check("GradComp" in type(fabric.strategy).__name__, f"Fabric chose {type(fabric.strategy).__name__}")
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(_sgd(model))
    before = _full(model)
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    check(_moved(before, model), "the model never moved")


@refused("Fabric gradcomp_fsdp, optimizer made before setup_module", "fabric", r"optimizer",
         r"fully_shard|setup_module|after", requires=("lightning_gradcomp:GradCompFabricFSDPStrategy",))
def _() -> str:
    fabric = _fabric(_strategy("GradCompFabricFSDPStrategy")(compressor="topk"))
    model = _net()
    optimizer = _sgd(model)  # the parameters before sharding
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(optimizer)
    before = _full(model)
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return "the model never moved" if not _moved(before, model) else "trained"


@refused("GradCompFabricFSDPStrategy shard_size 0", "fabric", r"`shard_size`", r">= 1",
         requires=("lightning_gradcomp:GradCompFabricFSDPStrategy",))
def _() -> None:
    _strategy("GradCompFabricFSDPStrategy")(shard_size=0)


@refused("GradCompFabricStrategy hierarchy", "fabric", r"hierarchy", r"Trainer's GradCompStrategy only",
         requires=(FABRIC_STRATEGY,))
def _() -> None:
    _strategy("GradCompFabricStrategy")(hierarchy="node")


@refused("Fabric DeMo with clip_gradients", "fabric", r"clip_gradients", r"allowed|no fabric.clip_gradients",
         requires=(FABRIC_STRATEGY,))
def _() -> None:
    fabric = _fabric(_strategy("GradCompFabricStrategy")(compressor=lg().DeMo(chunk=8, k=4), min_compress_numel=0))
    model = _mlp()
    model, optimizer = fabric.setup(model, _sgd(model))
    x, y = _batch(0)
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    fabric.clip_gradients(model, optimizer, max_norm=1.0)


@refused("Fabric gradcomp, a second model", "fabric", r"one model|second model|already", r"Fabric|setup",
         requires=(FABRIC_STRATEGY,))
def _() -> str:
    fabric = _fabric(_strategy("GradCompFabricStrategy")(compressor="topk"))
    first, second = _mlp(), _mlp(1)
    fabric.setup(first, _sgd(first))
    second, optimizer = fabric.setup(second, _sgd(second))
    x, y = _batch(0)
    fabric.backward(nn.functional.cross_entropy(second(x), y))
    optimizer.step()
    return "a second model set up and stepped"


@refused("GradCompFabricStrategy local_updates 0", "fabric", r"`sync_every`|`local_updates`", r">= 1",
         requires=(FABRIC_STRATEGY,))
def _() -> None:
    _strategy("GradCompFabricStrategy")(local_updates=0)


# ================================================================================================ simulation


@refused("GradCompSimStrategy workers 0", "simulation", r"`workers`", r">= 1", requires=(SIM_STRATEGY,))
def _() -> None:
    _strategy("GradCompSimStrategy")(workers=0)


@refused("GradCompSimStrategy uneven_batches drop", "simulation", r"`uneven_batches`", r"'pad', 'split' or 'error'",
         requires=(SIM_STRATEGY,))
def _() -> None:
    _strategy("GradCompSimStrategy")(uneven_batches="drop")


@refused("GradCompSimStrategy with devices=2", "simulation", r"devices=2", r"strategy='gradcomp'",
         requires=(SIM_STRATEGY,))
def _() -> None:
    _fit(_strategy("GradCompSimStrategy")(workers=2), devices=2)


@refused("GradCompSimStrategy uneven batch with 'error'", "simulation", r"uneven|does not split|divisible",
         r"'pad'|'split'|uneven_batches", requires=(SIM_STRATEGY,))
def _() -> None:
    import lightning as L

    module = _Module.make()
    x, y = _batch(0, n=10)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              strategy=_strategy("GradCompSimStrategy")(workers=2, compressor="none", uneven_batches="error")
              ).fit(module, data)


@refused("SimulatedLocalUpdates workers 0", "simulation", r"`workers`", r">= 1",
         requires=("lightning_gradcomp:SimulatedLocalUpdates",))
def _() -> None:
    model = _mlp()
    lg().SimulatedLocalUpdates(model, [_sgd(model)], lg().LocalUpdates(4), workers=0)


@legit("simulated none equals the whole batch", "simulation", requires=(SIM_STRATEGY,))
def _() -> None:
    import lightning as L

    module = _fit(_strategy("GradCompSimStrategy")(workers=2, compressor="none", print_summary=False,
                                                   log_stats=False), max_steps=4)
    plain = _Module.make()
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(plain, _data())
    for (name, a), b in zip(module.named_parameters(), plain.parameters()):
        check(torch.allclose(a, b, atol=1e-5), f"{name}: 2 simulated workers averaging halves differ from the batch")



# ================================================================================================ more single-process


@refused("use_compressor unknown name", "register", r"unknown name 'topkk'", r"allowed names", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk").use_compressor("topkk")


@refused("load_state_dict(None) on a register handle", "register", r"`state`", r"rank 0|every rank",
         requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk").load_state_dict(None)


@refused("LocalUpdates outer_optimizer as text", "local_updates", r"`outer_optimizer`", r"callable|functools.partial",
         requires=("lightning_gradcomp:LocalUpdates",))
def _() -> None:
    lg().LocalUpdates(4, outer_optimizer="sgd")


@refused("LocalUpdates an empty fragment", "local_updates", r"`fragments`", r"list of module names|module",
         requires=("lightning_gradcomp:LocalUpdates",))
def _() -> None:
    lg().LocalUpdates(4, fragments=[[], ["0"]])


@refused("GradCompStrategy hierarchy rack", "trainer", r"`hierarchy`", r"'none'.*'node'|'node'.*'none'",
         requires=(STRATEGY,))
def _() -> None:
    _strategy("GradCompStrategy")(hierarchy="rack")


@refused("GradCompStrategy fault_tolerance as text", "trainer", r"`fault_tolerance`", r"FaultTolerance\(",
         requires=(STRATEGY,))
def _() -> None:
    _strategy("GradCompStrategy")(local_updates=4, fault_tolerance="yes")


@refused("GradCompStrategy fault_tolerance without local_updates", "trainer", r"fault_tolerance", r"local_updates",
         requires=(STRATEGY, FT))
def _() -> None:
    _strategy("GradCompStrategy")(fault_tolerance=lg().FaultTolerance(lighthouse="http://127.0.0.1:1"))


@refused("Network bandwidth 0", "summary", r"`bandwidth_gbps`", r"> 0", requires=("lightning_gradcomp:Network",))
def _() -> None:
    lg().Network(bandwidth_gbps=0)


@legit("local_updates global_device cpu", "local_updates", requires=(LOCAL,))
def _() -> None:
    model = _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 2, global_device="cpu",
                                outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0))
    plain = _mlp()
    _train(model, optimizer, 4)
    handle.sync()
    _train(plain, _sgd(plain), 4)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        check(torch.allclose(a, b, atol=1e-6), f"{name} differs from plain SGD")
    handle.close()


@legit("Trainer gradcomp accumulate_grad_batches 2", "trainer", requires=(STRATEGY,))
def _() -> None:
    strategy = _strategy("GradCompStrategy")(compressor="topk", min_compress_numel=0, print_summary=False)
    module = _fit(strategy, accumulate_grad_batches=2, max_steps=2)
    check(module.steps == 4, f"{module.steps} batches for 2 optimizer steps of 2, expected 4")
    check(strategy.hook_state.step == 2, f"{strategy.hook_state.step} exchanges for 2 optimizer steps")


# ================================================================================================ multi-process


def _on(rank: int, first: Callable[[], Any], second: Callable[[], Any]) -> Any:
    return (first if rank == 0 else second)()


def _mismatch_case(name: str, area: str, setting: str, first: Callable[[], Any], second: Callable[[], Any],
                   requires: tuple[str, ...], **options: Any) -> None:
    def fn(rank: int, world: int) -> str:
        handle = _on(rank, first, second)
        return f"accepted ({type(handle).__name__})"

    _add(Case(name, area, fn, "refused", _mismatch(setting), world=2, requires=requires, **options))


def _ddp_reg(compressor: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: lg().register(_ddp(), compressor() if callable(compressor) else compressor, **kwargs)


def _local_reg(sync_every: int = 4, compressor: str = "none", **kwargs: Any) -> Callable[[], Any]:
    return lambda: _local(None, sync_every, compressor, **kwargs)


def _fsdp_reg(compressor: str = "topk", **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        model, mesh = _sharded()
        return lg().register_fsdp(model, mesh, compressor, **kwargs)
    return make


_mismatch_case("2 ranks: register density", "register", "compressor",
               _ddp_reg(lambda: lg().TopK(0.01)), _ddp_reg(lambda: lg().TopK(0.5)), (REGISTER,))
_mismatch_case("2 ranks: register compressor", "register", "compressor", _ddp_reg("topk"), _ddp_reg("qsgd"),
               (REGISTER,))
_mismatch_case("2 ranks: register min_compress_numel", "register", "min_compress_numel",
               _ddp_reg("topk", min_compress_numel=0), _ddp_reg("topk", min_compress_numel=10**6), (REGISTER,))
_mismatch_case("2 ranks: register error_feedback", "register", "error_feedback", _ddp_reg("topk"),
               _ddp_reg("topk", error_feedback=False), (REGISTER,))
_mismatch_case("2 ranks: register exchange_thread", "register", "exchange_thread",
               _ddp_reg("topk", exchange_thread=True), _ddp_reg("topk", exchange_thread=False), (REGISTER,))
_mismatch_case("2 ranks: local_updates H", "local_updates", "sync_every", _local_reg(4), _local_reg(8), (LOCAL,))
_mismatch_case("2 ranks: local_updates fragments", "local_updates", "fragments", _local_reg(4, fragments=1),
               _local_reg(4, fragments=2), (LOCAL,))
_mismatch_case("2 ranks: local_updates outer lr", "local_updates", "outer_optimizer",
               _local_reg(4, outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7)),
               _local_reg(4, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0)), (LOCAL,))
_mismatch_case("2 ranks: local_updates compressor", "local_updates", "compressor", _local_reg(4, "none"),
               _local_reg(4, "int8"), (LOCAL,))
_mismatch_case("2 ranks: local_updates delay", "local_updates", "delay", _local_reg(4, delay=0),
               _local_reg(4, delay=1), (LOCAL,))
_mismatch_case("2 ranks: register_fsdp compressor", "register_fsdp", "compressor", _fsdp_reg("topk"),
               _fsdp_reg("int8"), (REGISTER_FSDP,))
_mismatch_case("2 ranks: register_fsdp min_compress_numel", "register_fsdp", "min_compress_numel",
               _fsdp_reg(min_compress_numel=0), _fsdp_reg(min_compress_numel=10**6), (REGISTER_FSDP,))



_mismatch_case("2 ranks: register seed", "register", "seed", _ddp_reg("randomk", seed=0),
               _ddp_reg("randomk", seed=1), (REGISTER,))
_mismatch_case("2 ranks: local_updates alpha", "local_updates", "alpha", _local_reg(4, delay=1, alpha=0.0),
               _local_reg(4, delay=1, alpha=0.5), (LOCAL,))
_mismatch_case("2 ranks: local_updates overlap", "local_updates", "overlap", _local_reg(4, delay=1, overlap="after"),
               _local_reg(4, delay=1, overlap="before"), (LOCAL,))


@refused("2 ranks: Trainer with different local_updates H", "trainer", *_mismatch("sync_every"), world=2,
         requires=(STRATEGY,))
def _(rank: int, world: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    strategy = _strategy("GradCompStrategy")(compressor="none", local_updates=2 if rank == 0 else 4,
                                             print_summary=False)
    module = _fit(strategy, devices=world)
    return f"{module.steps} steps"


@refused("2 ranks: register on one rank, local_updates on the other", "local_updates", r"register\(\)",
         r"local_updates\(\)", r"every rank|same", world=2, requires=(REGISTER, LOCAL), isolated=True,
         env=WAIT_ENV, timeout=WAIT + 10)
def _(rank: int, world: int) -> str:
    model = _mlp()
    ddp = _ddp(model)
    if rank == 0:
        lg().register(ddp, "topk")
    else:
        lg().local_updates(model, _sgd(model), 4)
    return "accepted"


@refused("2 ranks: use_compressor on one rank only", "register", r"compressor", r"on rank 0|on rank 1|every rank",
         world=2, refusing=(0,), requires=(REGISTER,), isolated=True, env=WAIT_ENV, timeout=WAIT + 10)
def _(rank: int, world: int) -> str:
    ddp = _ddp()
    handle = lg().register(ddp, lg().TopK(0.1), min_compress_numel=0)
    optimizer = _sgd(ddp)

    def switch(step: int) -> None:
        if rank == 0 and step == 0:  # a schedule decided on rank 0 alone
            handle.use_compressor(lg().TopK(0.5))

    _train(ddp.module, optimizer, 3, rank, call=ddp, after=switch)
    return f"trained on; replicas equal: {_same_on_every_rank(ddp.module)}"


@refused("2 ranks: state_dict() on rank 0 only", "register", r"state_dict\(\)", r"every rank", world=2,
         refusing=(0,), requires=(REGISTER,), isolated=True, timeout=20)
def _(rank: int, world: int) -> str:
    ddp = _ddp()
    handle = lg().register(ddp, "topk", timeout=2)
    _train(ddp.module, _sgd(ddp), 1, rank, call=ddp)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            handle.state_dict()
        finally:
            store.set("misuse/saved", "done")
        return "state_dict() returned on rank 0 alone"
    store.wait(["misuse/saved"])
    return ""


@refused("2 ranks: register_fsdp, different fully_shard wrapping", "register_fsdp", r"shard|layout|fully_shard",
         r"on rank 0", r"on rank 1", world=2, requires=(REGISTER_FSDP,), isolated=True, timeout=30)
def _(rank: int, world: int) -> str:
    model, mesh = _sharded(blocks=rank == 0)  # rank 1 shards the root only: one FSDP group, not three
    lg().register_fsdp(model, mesh, "topk", min_compress_numel=0)
    _train(model, _sgd(model), 2, rank)
    return f"trained; replicas equal: {_same_on_every_rank(model)}"


@refused("2 ranks: local_updates, different model widths", "local_updates", r"shape|size|parameter",
         r"rank 0|rank 1|every rank", world=2, requires=(LOCAL,), isolated=True, timeout=30)
def _(rank: int, world: int) -> str:
    model = _mlp(width=64 if rank == 0 else 80)
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 2)
    _train(model, optimizer, 2, rank)
    handle.sync()
    return "trained"


@refused("2 ranks: Trainer with different compressors", "trainer", *_mismatch("compressor"), world=2,
         requires=(STRATEGY,))
def _(rank: int, world: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    strategy = _strategy("GradCompStrategy")(compressor="topk" if rank == 0 else "qsgd", print_summary=False)
    module = _fit(strategy, devices=world)
    return f"{module.steps} steps"


@refused("2 ranks: GradCompFSDPStrategy with different compressors", "trainer", *_mismatch("compressor"), world=2,
         requires=(FSDP_STRATEGY,))
def _(rank: int, world: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    strategy = _strategy("GradCompFSDPStrategy")(compressor="topk" if rank == 0 else "int8", shard_size=1,
                                                 print_summary=False)
    module = _fit(strategy, _Module.make(configure_model=True), devices=world)
    return f"{module.steps} steps"


@refused("2 ranks: Fabric with different compressors", "fabric", *_mismatch("compressor"), world=2,
         requires=(FABRIC_STRATEGY,))
def _(rank: int, world: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    fabric = _fabric(_strategy("GradCompFabricStrategy")(compressor="topk" if rank == 0 else "qsgd"), devices=world)
    model = _mlp()
    model, optimizer = fabric.setup(model, _sgd(model))
    x, y = _batch(0, rank)
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    return "a step"


@refused("2 ranks: Fabric gradcomp_fsdp with different compressors", "fabric", *_mismatch("compressor"), world=2,
         requires=("lightning_gradcomp:GradCompFabricFSDPStrategy",))
def _(rank: int, world: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    fabric = _fabric(_strategy("GradCompFabricFSDPStrategy")(compressor="topk" if rank == 0 else "int8", shard_size=1),
                     devices=world)
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(_sgd(model))
    x, y = _batch(0, rank)
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    return "a step"


@refused("2 ranks: a rank calls sync() alone mid-window", "local_updates", r"rank 0: step 4", r"rank 1: step 2",
         world=2, requires=(LOCAL,))
def _(rank: int, world: int) -> str:
    model = _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 4, "int8")
    _train(model, optimizer, 4, rank, after=lambda step: handle.sync() if rank == 1 and step == 1 else None)
    return "the lone sync() went unnoticed"


@legit("2 ranks: register topk trains, replicas equal", "register", world=2, requires=(REGISTER,))
def _(rank: int, world: int) -> None:
    ddp = _ddp()
    handle = lg().register(ddp, lg().TopK(0.1), min_compress_numel=0)
    losses = _train(ddp.module, _sgd(ddp), 6, rank, call=ddp)
    check(_same_on_every_rank(ddp.module), "the replicas drifted apart")
    check(handle.step_stats.bytes_sent > 0, "no bytes counted")
    handle.close()
    del losses


@legit("2 ranks: local_updates int8 ends on one theta_global", "local_updates", world=2, requires=(LOCAL,))
def _(rank: int, world: int) -> None:
    model = _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 2, "int8", min_compress_numel=0)
    before = _full(model)
    _train(model, optimizer, 5, rank)
    handle.sync()
    check(_same_on_every_rank(model), "the ranks end on different weights after sync()")
    check(_moved(before, model), "the model never moved")
    handle.close()


@legit("2 ranks: register_fsdp topk trains, replicas equal", "register_fsdp", world=2, requires=(REGISTER_FSDP,))
def _(rank: int, world: int) -> None:
    model, mesh = _sharded()
    handle = lg().register_fsdp(model, mesh, "topk", min_compress_numel=0)
    before = _full(model)
    _train(model, _sgd(model), 3, rank)
    check(_same_on_every_rank(model), "the replicas drifted apart")
    check(_moved(before, model), "the model never moved")
    handle.close()


# ---------------------------------------------------------------------------------------------- a rank missing


def _absent(rank: int, world: int, call: Callable[[], Any]) -> str:
    """Rank 0 calls ``call``; rank 1 stays alive doing something else (it never calls it) until rank 0 is done."""
    if rank == 0:
        try:
            call()
        finally:
            dist.distributed_c10d._get_default_store().set("misuse/absent", "done")
        return "returned without the other rank"
    dist.distributed_c10d._get_default_store().wait(["misuse/absent"])
    return ""


def _waited(call: str, absent: int = 1) -> tuple[str, ...]:
    """The phrases of a bounded wait's message: the call, the waiting rank, the bound, the absent rank."""
    return (rf"{call}", rf"rank {1 - absent}", rf"{WAIT}(\.0)? ?s|{WAIT} seconds", r"every rank|all ranks|other ranks?",
            rf"rank {absent} never reached it")


@refused("2 ranks: summary() on rank 0 only", "register", *_waited(r"summary\(\)"), r"rank 1 never reached it",
         r"text = handle.summary\(\)", world=2, refusing=(0,), isolated=True, env=WAIT_ENV, timeout=WAIT + 10,
         requires=(REGISTER,))
def _(rank: int, world: int) -> str:
    ddp = _ddp()
    handle = lg().register(ddp, "topk")
    _train(ddp.module, _sgd(ddp), 1, rank, call=ddp)
    return _absent(rank, world, handle.summary)  # the natural `if rank == 0: print(handle.summary())`


@refused("2 ranks: one never calls register", "register", *_waited(r"register\(\)"), world=2, refusing=(0,),
         isolated=True, env=WAIT_ENV, timeout=WAIT + 10, requires=(REGISTER,))
def _(rank: int, world: int) -> str:
    ddp = _ddp()  # DDP's own construction is a collective: both ranks wrap; only rank 0 registers
    return _absent(rank, world, lambda: lg().register(ddp, "topk"))


@refused("2 ranks: one never calls local_updates", "local_updates", *_waited(r"local_updates\(\)"), world=2,
         refusing=(0,), isolated=True, env=WAIT_ENV, timeout=WAIT + 10, requires=(LOCAL,))
def _(rank: int, world: int) -> str:
    return _absent(rank, world, lambda: _local(None, 4))


@refused("2 ranks: one never calls register_fsdp", "register_fsdp", *_waited(r"register_fsdp\(\)"), world=2,
         refusing=(0,), isolated=True, env=WAIT_ENV, timeout=WAIT + 10, requires=(REGISTER_FSDP,))
def _(rank: int, world: int) -> str:
    model, mesh = _sharded()  # the mesh is made on both ranks; only rank 0 registers
    return _absent(rank, world, lambda: lg().register_fsdp(model, mesh, "topk"))


@refused("2 ranks: sync() alone, the other rank done", "local_updates", *_waited(r"sync\(\)", absent=0), world=2,
         refusing=(1,),
         isolated=True, env=WAIT_ENV, timeout=WAIT + 10, requires=(LOCAL,))
def _(rank: int, world: int) -> str:
    model = _mlp()
    optimizer = _sgd(model)
    handle = lg().local_updates(model, optimizer, 4)
    _train(model, optimizer, 2, rank)  # both ranks: two inner steps, no synchronisation due
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # a final sync() on rank 1 only (rank 0's loop ended without one)
        try:
            handle.sync()
        finally:
            store.set("misuse/lone", "done")
        return "the lone sync() returned"
    store.wait(["misuse/lone"])
    return ""


# ------------------------------------------------------------------ found by a second, unseen trial (session 20)
@refused("summary(network) given as text", "summary", r"`network`", r"Network\(bandwidth_gbps=", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk").summary("10gbit")


@refused("load_state_dict of a whole checkpoint", "register", r"not a compression-state entry",
         r"checkpoint\['gradcomp'\]", requires=(REGISTER,))
def _() -> None:
    lg().register(_ddp(), "topk").load_state_dict({"model": {}, "optimizer": {}, "epoch": 3})


@refused("FaultTolerance replica_id an int", "fault tolerance", r"`FaultTolerance.replica_id`", r"str", requires=(FT,))
def _() -> None:
    lg().FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=7)


@refused("FaultTolerance timeout infinite", "fault tolerance", r"`FaultTolerance.timeout`", r"finite",
         requires=(FT,))
def _() -> None:
    lg().FaultTolerance(lighthouse="http://127.0.0.1:1", timeout=float("inf"))


@refused("local_updates step() after close()", "local_updates", r"step\(\) after close\(\)", r"before close\(\)",
         requires=(LOCAL,))
def _() -> None:
    handle = _local(None, 4)
    handle.close()
    handle.step()


@refused("local_updates step() where a strategy counts the steps", "local_updates", r"step\(\)",
         r"count each iteration twice|leave it out", requires=(LOCAL,))
def _() -> None:
    handle = _local(None, 4)
    handle.counted_by_strategy = "GradCompFabricStrategy(local_updates=...)"  # as the Fabric strategies set it
    handle.step()


@refused("2 ranks: load_state_dict on rank 0 only", "register", *_waited(r"load_state_dict\(\)"), world=2,
         refusing=(0,), isolated=True, env=WAIT_ENV, timeout=WAIT + 10, requires=(REGISTER,))
def _(rank: int, world: int) -> str:
    ddp = _ddp()
    handle = lg().register(ddp, "randomk", min_compress_numel=0)
    _train(ddp.module, _sgd(ddp), 2, rank, call=ddp)
    entry = [handle.state_dict()]
    dist.broadcast_object_list(entry)
    return _absent(rank, world, lambda: handle.load_state_dict(entry[0]))  # `if rank == 0: handle.load_state_dict(...)`


@legit("a local_updates entry loaded by register() is said to be one", "register", requires=(REGISTER, LOCAL))
def _() -> None:
    model = _mlp()
    local = _local(model, 4)
    entry = local.state_dict()
    local.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lg().register(_ddp(), "topk").load_state_dict(entry)
    check(any("written under local updates" in str(w.message) for w in caught), "no word about the entry's kind")


@legit("a register() entry loaded by local_updates is said to be one", "local_updates", requires=(REGISTER, LOCAL))
def _() -> None:
    handle = lg().register(_ddp(), "topk")
    entry = handle.state_dict()
    handle.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _local(None, 4, "topk").load_state_dict(entry)
    check(any("holds no local-update state" in str(w.message) for w in caught), "no word about the entry's kind")


# ---------------------------------------------------------------------------------------------- 2 x 2


@refused("4 ranks: register_fsdp, model sharded over mesh['replicate']", "register_fsdp", r"mesh\['shard'\]",
         r"fully_shard\(module, mesh=mesh\['shard'\]\)|other ranks", world=4, requires=(REGISTER_FSDP,))
def _(rank: int, world: int) -> None:
    mesh = _mesh((2, 2))
    lg().register_fsdp(_shard(_net(), mesh["replicate"]), mesh, "topk")


@refused("4 ranks: local_updates(mesh), model sharded over mesh['replicate']", "local_updates", r"mesh\['shard'\]",
         r"fully_shard\(module, mesh=mesh\['shard'\]\)|other ranks", world=4, requires=(LOCAL,))
def _(rank: int, world: int) -> None:
    mesh = _mesh((2, 2))
    model = _shard(_net(), mesh["replicate"])
    lg().local_updates(model, _sgd(model), 4, mesh=mesh)


@legit("4 ranks: register_fsdp none equals native HSDP", "register_fsdp", world=4, requires=(REGISTER_FSDP,))
def _(rank: int, world: int) -> None:
    mesh = _mesh((2, 2))
    native = _shard(_net(), mesh)
    _train(native, _sgd(native), 2, rank)
    ours = _shard(_net(), mesh["shard"])
    handle = lg().register_fsdp(ours, mesh, "none", min_compress_numel=0)
    _train(ours, _sgd(ours), 2, rank)
    expected, got = _full(native), _full(ours)
    differ = [name for name in expected if not torch.equal(expected[name], got[name])]
    check(not differ, f"differs from native HSDP: {', '.join(differ[:3])}")
    handle.close()
