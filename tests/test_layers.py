"""The package's layers, read from its import graph: no module imports a higher layer or a sibling package
of its own layer (``ddp/``, ``fsdp/`` and ``local/`` are siblings over the exchange session), nothing below
the Lightning layer imports Lightning, and no package's modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gradcomp"

#: Bottom to top. A module may import its own package and the layers below it.
LAYERS = {
    "core": 0,
    "compressors": 1,
    "metrics": 1,
    "exchange": 2,
    "ddp": 3,  # the three adapters over the exchange session, side by side
    "fsdp": 3,
    "local": 3,
    "wiring": 4,  # one map from an entry point's plan to its adapter, and the plain entry points
    "lightning": 5,
    "tools": 6,
    "examples": 6,
    "": 7,  # the package root: public API, registration, public import paths
}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _place(module: str) -> str:
    """The layer package of a dotted module name inside the package ("" for the root's own modules)."""
    parts = module.split(".")[1:]
    return parts[0] if parts and parts[0] in LAYERS else ""


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        modules[".".join(parts)] = path
    return modules


def test_no_module_imports_a_higher_layer_or_a_sibling_package() -> None:
    modules = _modules()
    assert set(_place(name) for name in modules) <= set(LAYERS), "every package has a layer"
    wrong = []
    for name, path in sorted(modules.items()):
        place = _place(name)
        for imported in _imports(path):
            if not imported.startswith("lightning_gradcomp."):
                continue
            target = _place(imported)
            if target == place:
                continue
            if LAYERS[target] >= LAYERS[place]:
                wrong.append(f"{name} ({place or 'root'}) imports {imported} ({target or 'root'})")
    assert not wrong, "\n".join(wrong)


def test_nothing_below_the_lightning_layer_imports_lightning() -> None:
    wrong = []
    for name, path in sorted(_modules().items()):
        if LAYERS[_place(name)] >= LAYERS["lightning"]:
            continue
        for imported in _imports(path):
            if imported.split(".")[0] in LIGHTNING:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


#: the builders of the six rows of the wiring (lightning_gradcomp/wiring/plan.py), one per adapter and mode
ROW_BUILDERS = {"attach_ddp", "attach_fsdp", "attach", "attach_fault_tolerant", "attach_sharded",
                "attach_fault_tolerant_sharded"}


def test_one_wiring_builds_every_exchange() -> None:
    """Every entry point (the strategies, register, register_fsdp, local_updates) builds its exchange through
    ``wiring.attach_exchange``: no module above the adapters calls a row's builder itself, and no module
    builds an exchange session outside the adapters and the exchange layer."""
    wrong = []
    for name, path in sorted(_modules().items()):
        if LAYERS[_place(name)] < LAYERS["wiring"] or name == "lightning_gradcomp.wiring.plan":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if called in ROW_BUILDERS | {"ExchangeSession", "GradCompHookState", "HierarchicalHookState",
                                             "LocalUpdateLoop", "fault_tolerant_loop", "ShardedLocalUpdateLoop"}:
                    wrong.append(f"{name}:{node.lineno} calls {called}")
    assert not wrong, "\n".join(wrong)


def test_the_adapters_stand_side_by_side_over_the_exchange_session() -> None:
    """The sibling rule by name, so that a change of the layer numbers cannot drop it."""
    assert LAYERS["ddp"] == LAYERS["fsdp"] == LAYERS["local"] == LAYERS["exchange"] + 1


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports at module level or in a function (``from package import
    module`` counted as the module)."""
    found = set()
    for imported in _imports(path):
        if imported in modules:
            found.add(imported)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules}
    found.discard(name)
    return found


def test_no_import_circle() -> None:
    """No module reaches itself through imports (``TYPE_CHECKING`` imports included): a circle makes the
    order of imports matter and hides which module is the lower one."""
    modules = _modules()
    graph = {name: {m for m in _module_imports(name, path, modules) if not m.endswith("__init__")}
             for name, path in modules.items()}
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    circles = []
    for start in sorted(graph):
        if start in packages:
            continue
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    circles.append(" -> ".join(path + [start]))
                elif nxt not in seen and nxt not in packages:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not circles, "\n".join(sorted(set(circles))[:10])


def test_no_strategy_module_imports_another_at_module_level() -> None:
    """Lightning's own import registers every strategy module (lightning_gradcomp/_registration.py), possibly
    while the module that imported Lightning is half-executed: a strategy module that imports another at
    module level would then find it half-defined and the registration would fail (as ``fabric_fsdp`` did
    importing ``fsdp_strategy``). What they share lives in modules that import no Lightning (``sharding``,
    ``fabric_exchange``, ``options``, ``step_figures``)."""
    from lightning_gradcomp._registration import STRATEGY_CLASSES

    modules = set(STRATEGY_CLASSES.values())
    root = Path(__file__).parents[1]
    for module in modules:
        tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
        imported = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)} | \
            {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & (modules - {module}), f"{module} imports {sorted(imported & modules)} at module level"
    for shared in ("sharding.py", "fabric_exchange.py", "options.py", "step_figures.py"):
        sharing = (root / "lightning_gradcomp/lightning" / shared).read_text()
        assert "import lightning\n" not in sharing and "from lightning." not in sharing, shared
