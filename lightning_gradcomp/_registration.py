"""The ``"gradcomp"`` strategies in Lightning's registries, without importing Lightning.

``import lightning_gradcomp`` must not cost a plain-PyTorch user Lightning's import (several seconds per
process), yet ``Trainer(strategy="gradcomp")`` and ``Fabric(strategy="gradcomp")`` must find the strategies
however the imports are ordered. The strategy modules register themselves when they are imported
(``lightning_gradcomp.lightning.strategy``, ``.simulation``, ``.fabric``, ``.fsdp_strategy``,
``.fabric_fsdp``); this module
imports them:

* at once, when Lightning is already imported;
* otherwise right after Lightning's own import completes (an import hook on the top-level ``lightning``
  package, removed once it has fired), so that the registries hold the strategies before any Trainer or
  Fabric can be built.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

#: The strategy classes, by public name, and their modules (each registers its strategies at its end).
STRATEGY_CLASSES = {
    "GradCompStrategy": "lightning_gradcomp.lightning.strategy",
    "GradCompSimStrategy": "lightning_gradcomp.lightning.simulation",
    "GradCompFabricStrategy": "lightning_gradcomp.lightning.fabric",
    "GradCompFSDPStrategy": "lightning_gradcomp.lightning.fsdp_strategy",
    "GradCompFabricFSDPStrategy": "lightning_gradcomp.lightning.fabric_fsdp",
}


def import_strategy_modules() -> None:
    """Import the strategy modules (registering the strategies). A module being imported right now (the
    import of Lightning started from inside it) registers its strategies when it finishes."""
    for module in STRATEGY_CLASSES.values():
        importlib.import_module(module)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds the top-level ``lightning`` package through the other finders and has its loader import the
    strategy modules once the package has run."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Any:
        if fullname != "lightning":
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            run(module)
            try:
                import_strategy_modules()
            except Exception as error:  # noqa: BLE001 - Lightning's own import must not fail because of us
                warnings.warn(f"lightning-gradcomp: registering the 'gradcomp' strategies failed: {error!r}; "
                              "`import lightning_gradcomp.lightning.strategy` shows why", stacklevel=2)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


_hook: Optional[_AfterLightning] = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def install() -> None:
    """Register the strategies now if Lightning is imported, else as soon as it is (idempotent)."""
    global _hook
    if sys.modules.get("lightning") is not None:
        import_strategy_modules()
    elif _hook is None:
        _hook = _AfterLightning()
        sys.meta_path.insert(0, _hook)
        logger.debug("lightning-gradcomp: the strategies register when Lightning is imported")
