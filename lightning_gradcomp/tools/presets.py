"""The presets shipped with the package: recipes (complete runs) and configs (compressors, networks,
strategies), found in an installed wheel (``lightning_gradcomp/_presets/``) or in the checkout.

``gradcomp fit --config quickstart_digits.yaml`` takes a recipe by file name where no such file exists
in the working directory; ``gradcomp presets`` lists them with their paths (copy one to change it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_PACKAGE = Path(__file__).resolve().parents[1]
KINDS = ("recipes", "configs")


def preset_root() -> Optional[Path]:
    """The folder holding ``recipes/`` and ``configs/``: inside the installed package, or the checkout's
    root (an editable install); ``None`` if neither has them."""
    for root in (_PACKAGE / "_presets", _PACKAGE.parent):
        if all((root / kind).is_dir() for kind in KINDS):
            return root
    return None


def presets() -> dict[str, Path]:
    """Every preset, by its path relative to the preset root (``recipes/quickstart_digits.yaml``)."""
    root = preset_root()
    if root is None:
        return {}
    return {str(path.relative_to(root)): path for kind in KINDS for path in sorted((root / kind).rglob("*.yaml"))}


def resolve_config(value: str) -> str:
    """``value`` unchanged when it names a file (or is not a path at all); else the preset it names, by
    file name (``quickstart_digits.yaml``, ``quickstart_digits``) or by its relative path
    (``recipes/quickstart_digits.yaml``, ``configs/compressors/topk_50x.yaml``)."""
    if Path(value).exists() or not value or "\n" in value:
        return value
    found = presets()
    name = value if value.endswith(".yaml") else f"{value}.yaml"
    if name in found:
        return str(found[name])
    matches = [path for relative, path in found.items() if Path(relative).name == Path(name).name]
    return str(matches[0]) if len(matches) == 1 else value


def describe() -> str:
    """The ``gradcomp presets`` listing."""
    root = preset_root()
    if root is None:
        return "gradcomp: no presets found (neither an installed package's nor a checkout's)"
    lines = [f"presets in {root}:"]
    lines += [f"  {relative}" for relative in presets()]
    lines.append("use a recipe with `gradcomp fit --config NAME.yaml` (its file name is enough)")
    return "\n".join(lines)
