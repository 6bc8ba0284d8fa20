"""The documentation's Python code blocks as tests: README.md and every page of docs/ (Sybil collects them,
`conftest.py` at the repository root; `python -m pytest -q README.md docs` runs only them).

A ```` ```python ```` block runs in one of four ways, chosen by an HTML comment on the line before it (invisible
on GitHub and on the site):

- no comment: it **runs as it is**, in this process, after the page's earlier blocks, in one namespace per page
  (so a page can build a model in one block and train it in the next), in a fresh temporary directory. The
  page's namespace starts with the names of :func:`page_namespace` (a small model, its optimizer and batches,
  ``rank = 0``, ...), the names a snippet in a guide takes for granted;
- ``<!-- docs: processes N -->``: the block is a **complete script**, run by a real ``torchrun
  --nproc-per-node N`` (:func:`tests._processes.run_torchrun`: fresh interpreters, nothing imported
  beforehand, as a user's run: a script that forgets an import fails here too); it must succeed; its
  imports, functions and classes are then defined for the page's later blocks;
- ``<!-- docs: torchft-groups N -->``: the block is the script of a fault-tolerant replica group, run as N
  groups of one process (fresh interpreters) joined by a torchft lighthouse started for it
  (:func:`run_as_torchft_groups`);
- ``<!-- docs: cluster-only -->``: the block needs what this machine lacks (GPUs, several nodes, a lighthouse
  elsewhere). It is compiled, its imports are run, every name it reads must be bound by the block itself, by
  the page's namespace or by Python, every ``module.attribute`` chain from an imported module must resolve, and
  every keyword it passes to a class or function of this package must be one that signature accepts.

"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import inspect
import os
import re
import subprocess
import symtable
import sys
import tempfile
import textwrap
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

_DIRECTIVE = re.compile(r"<!--\s*docs:\s*(?P<kind>processes|torchft-groups|cluster-only)\s*(?P<argument>\d*)\s*-->\s*$")
_SCRIPT_TIMEOUT = 240.0
#: a strategy given by its registered name, which only ``import lightning_gradcomp`` registers
_NAMED_STRATEGY = re.compile(r"""strategy\s*=\s*["']gradcomp""")
_IMPORTS_THE_PACKAGE = re.compile(r"^\s*(?:import lightning_gradcomp\b|from lightning_gradcomp\b)", re.M)


def page_namespace() -> dict[str, Any]:
    """The names every page's blocks may use without defining them: the usual imports, and a small model
    with what a training loop around it holds (its optimizer, a loader of a few batches, one batch ``x, y``,
    a loss function, this process's ``rank`` of a one-process world, a checkpoint ``path``)."""
    import lightning as L
    import torch
    from torch import nn

    import lightning_gradcomp

    torch.manual_seed(0)

    class Block(nn.Module):
        """A residual MLP block, the unit a snippet shards or wraps (``auto_wrap_policy={Block}``)."""

        def __init__(self, width: int = 16) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.linear(x))

    class TinyNet(nn.Module):
        """Embedding layer, two :class:`Block` in ``layers``, a head: 8 features in, 4 classes out."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.layers:
                x = block(x)
            return self.head(x)

    model = TinyNet()
    batches = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(4)]
    x, y = batches[0]
    return {
        "torch": torch, "nn": nn, "L": L, "lightning_gradcomp": lightning_gradcomp, "functools": functools,
        "os": os, "Block": Block, "TinyNet": TinyNet, "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loader": batches, "x": x, "y": y,
        "loss_fn": nn.functional.cross_entropy, "evaluate": lambda model: None,
        "rank": 0, "local_rank": 0, "world_size": 1, "total_steps": 8, "path": "checkpoint.pt",
    }


# ---- the four ways a block runs -------------------------------------------------------------------------------

def check_registration(example: Example) -> None:
    """A block that names a strategy (``strategy="gradcomp"``) needs ``import lightning_gradcomp`` in it or in an
    earlier block of its page: this process has the package imported already (and the page's namespace holds
    it), so only this check catches a snippet that would fail as a reader copies it."""
    if _IMPORTS_THE_PACKAGE.search(example.parsed):
        example.namespace["_docs_package_imported"] = True
    assert not _NAMED_STRATEGY.search(example.parsed) or example.namespace.get("_docs_package_imported"), (
        f'{_where(example)}: names a "gradcomp" strategy, but neither it nor an earlier block of the page runs '
        "`import lightning_gradcomp`, which registers the strategies")


def run_in_page(example: Example) -> None:
    """Run the block in the page's namespace (see the module's docstring)."""
    check_registration(example)
    code = compile(example.parsed, _where(example), "exec")
    exec(code, example.namespace)  # noqa: S102 - the documentation's own code


def run_as_processes(nprocs: int) -> Callable[[Example], None]:
    """Run the block as a complete script in ``nprocs`` processes, as ``torchrun`` would."""

    def evaluate(example: Example) -> None:
        from tests._processes import run_torchrun

        with tempfile.TemporaryDirectory(prefix="docs-block-") as folder:
            script = Path(folder) / "train.py"
            script.write_text(example.parsed)
            try:
                run_torchrun(script, Path(folder), nproc=nprocs, timeout=_SCRIPT_TIMEOUT)
            except AssertionError as failure:
                raise AssertionError(f"{_where(example)} failed under torchrun:\n{failure}") from None
        check_registration(example)  # (it ran on its own: what it imports counts for the page's later blocks)
        _define_in_page(example)

    return evaluate


def _define_in_page(example: Example) -> None:
    """What a script block defines at its top level (imports, functions, classes) is defined for the page's
    later blocks too, as if the page were one file: a script's LightningModule can be reused below it."""
    tree = ast.parse(example.parsed)
    definitions = [node for node in tree.body
                   if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
    exec(compile(ast.Module(definitions, []), _where(example), "exec"), example.namespace)  # noqa: S102


def run_as_torchft_groups(groups: int) -> Callable[[Example], None]:
    """Run the block as the script of ``groups`` fault-tolerant replica groups of one process each, joined by a
    torchft lighthouse started here, as the fault-tolerance page launches them (``REPLICA_GROUP_ID``,
    ``TORCHFT_LIGHTHOUSE`` and a ``MASTER_PORT`` of its own for each group)."""

    def evaluate(example: Example) -> None:
        from torchft._torchft import LighthouseServer

        from tests._processes import free_port

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1500)
        try:
            with tempfile.TemporaryDirectory(prefix="docs-block-") as folder:
                script = Path(folder) / "train.py"
                script.write_text(example.parsed)
                runs = [subprocess.Popen([sys.executable, str(script)], cwd=folder, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=dict(
                    os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn", REPLICA_GROUP_ID=f"group{group}",
                    TORCHFT_LIGHTHOUSE=lighthouse.address(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
                    for group in range(groups)]
                outcomes = [_finish(run) for run in runs]
        finally:
            lighthouse.shutdown()
        failed = [(group, output[-3000:]) for group, (code, output) in enumerate(outcomes) if code != 0]
        assert not failed, f"{_where(example)}: groups that failed: {failed}"

    return evaluate


def _finish(run: subprocess.Popen) -> tuple[int, str]:
    """A process's exit code and output, killed after :data:`_SCRIPT_TIMEOUT` seconds."""
    try:
        output, _ = run.communicate(timeout=_SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        run.kill()
        output, _ = run.communicate()
    return run.returncode, output


def check_cluster_only(example: Example) -> None:
    """Compile the block, run its imports and resolve its names, attributes and keywords (no training)."""
    check_registration(example)
    source = example.parsed
    where = _where(example)
    tree = ast.parse(source, where)
    imported: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), where, "exec"), imported)  # noqa: S102
    known = set(example.namespace) | set(imported) | set(dir(builtins))
    unbound = sorted(_free_names(source, where) - known)
    assert not unbound, f"{where}: names neither defined in the block, nor imported, nor on the page: {unbound}"
    scope = {**example.namespace, **imported}
    for chain, node in _attribute_chains(tree):
        _resolve(chain, scope, where, node)
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        _check_keywords(call, scope, where)


# ---- the cluster-only checks ----------------------------------------------------------------------------------

def _free_names(source: str, where: str) -> set[str]:
    """Names the block reads from the module scope without binding them there (any nesting level)."""
    table = symtable.symtable(source, where, "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    free: set[str] = set()

    def visit(scope: symtable.SymbolTable) -> None:
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (scope is table or symbol.is_global()) and symbol.get_name() not in bound:
                if not (scope is table and (symbol.is_assigned() or symbol.is_imported())):
                    free.add(symbol.get_name())
        for child in scope.get_children():
            visit(child)

    visit(table)
    return free


def _attribute_chains(tree: ast.AST) -> Iterable[tuple[list[str], ast.AST]]:
    """``a.b.c`` read anywhere in the block, as ``["a", "b", "c"]`` (the longest chain of each expression)."""
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain: list[str] = []
            current: ast.AST = node
            while isinstance(current, ast.Attribute):
                chain.insert(0, current.attr)
                current = current.value
            if isinstance(current, ast.Name):
                yield [current.id, *chain], node


def _resolve(chain: list[str], scope: dict[str, Any], where: str, node: ast.AST) -> None:
    """Follow ``chain`` from a module while the objects are modules or classes: each step must exist."""
    obj = scope.get(chain[0])
    if not isinstance(obj, types.ModuleType):
        return
    for depth, name in enumerate(chain[1:], start=1):
        if not isinstance(obj, (types.ModuleType, type)):
            return
        assert hasattr(obj, name), f"{where}, line {node.lineno}: {'.'.join(chain[:depth + 1])} does not exist"
        obj = getattr(obj, name)


def _callee(func: ast.AST, scope: dict[str, Any]) -> Optional[Any]:
    """The object a call's function expression names, when it is a plain name or a chain from one."""
    chain: list[str] = []
    while isinstance(func, ast.Attribute):
        chain.insert(0, func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in scope:
        return None
    obj = scope[func.id]
    for name in chain:
        if not isinstance(obj, (types.ModuleType, type)) or not hasattr(obj, name):
            return None
        obj = getattr(obj, name)
    return obj


def _check_keywords(call: ast.Call, scope: dict[str, Any], where: str) -> None:
    """A keyword passed to a class or function of this package must be a parameter of its signature."""
    obj = _callee(call.func, scope)
    if obj is None or not getattr(obj, "__module__", "").startswith("lightning_gradcomp"):
        return
    with contextlib.suppress(TypeError, ValueError):  # no signature to read
        signature = inspect.signature(obj)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            return
        unknown = [k.arg for k in call.keywords if k.arg is not None and k.arg not in signature.parameters]
        assert not unknown, f"{where}, line {call.lineno}: {obj.__qualname__} takes no {unknown}"


# ---- collection ---------------------------------------------------------------------------------------------------

def _where(example: Example) -> str:
    return f"{example.path}, block at line {example.line}"


def parse_python_blocks(document: Document) -> Iterable[Region]:
    """Every ```` ```python ```` block of ``document``, with the evaluator its directive (if any) asks for."""
    for region in FencedCodeBlockLexer("python")(document):
        before = document.text[:region.start].rstrip("\n").rsplit("\n", 1)[-1]
        match = _DIRECTIVE.search(before)
        source = textwrap.dedent(region.lexemes["source"])
        if match is None:
            evaluator: Callable[[Example], None] = run_in_page
        elif match["kind"] == "processes":
            evaluator = run_as_processes(int(match["argument"] or 2))
        elif match["kind"] == "torchft-groups":
            evaluator = run_as_torchft_groups(int(match["argument"] or 2))
        else:
            evaluator = check_cluster_only
        yield Region(region.start, region.end, parsed=source, evaluator=evaluator)


def _enter_page(namespace: dict[str, Any]) -> None:
    """Sybil's set-up of a page: its namespace, and a temporary working directory its blocks may write into."""
    folder = tempfile.TemporaryDirectory(prefix="docs-page-")
    namespace.update(page_namespace())
    from lightning_gradcomp.compressors import COMPRESSORS

    namespace["_docs_restore"] = (os.getcwd(), folder, dict(os.environ), dict(COMPRESSORS))
    os.chdir(folder.name)


def _leave_page(namespace: dict[str, Any]) -> None:
    from lightning_gradcomp.compressors import COMPRESSORS

    cwd, folder, environ, compressors = namespace.pop("_docs_restore")
    COMPRESSORS.clear()  # a compressor a page defines (adding-a-compressor.md) is not left registered
    COMPRESSORS.update(compressors)
    os.chdir(cwd)
    folder.cleanup()
    os.environ.clear()  # what a Trainer or Fabric built on the page set (MASTER_PORT, ...) would reach later tests
    os.environ.update(environ)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a block that made a one-process group
        dist.destroy_process_group()


def collector(root: Path) -> Callable[..., Any]:
    """The ``pytest_collect_file`` hook for the repository's root ``conftest.py``."""
    from sybil import Sybil

    return Sybil(parsers=[parse_python_blocks], patterns=["README.md", "docs/*.md", "docs/*/*.md"],
                 path=str(root), setup=_enter_page, teardown=_leave_page).pytest()
