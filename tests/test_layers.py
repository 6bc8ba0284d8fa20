"""The package's layers, read from its import graph: no module imports a higher layer (or a sibling
package of its own layer), and nothing below the Lightning layer imports Lightning."""

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
    "ddp": 3,
    "local": 4,
    "fsdp": 5,
    "lightning": 6,
    "tools": 7,
    "examples": 7,
    "": 8,  # the package root: public API, registration, public import paths
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
