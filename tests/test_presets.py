"""Every compressor preset in configs/compressors builds, and every registered compressor has one."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from lightning_gradcomp.compressors import COMPRESSORS, Compressor

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs" / "compressors").glob("*.yaml"))


def _build(path: Path) -> Compressor:
    spec = yaml.safe_load(path.read_text())
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))


@pytest.mark.parametrize("path", PRESETS, ids=[path.stem for path in PRESETS])
def test_preset_builds_a_compressor(path: Path) -> None:
    assert isinstance(_build(path), Compressor)


def test_every_compressor_of_the_package_has_a_preset() -> None:
    ours = {name for name, cls in COMPRESSORS.items() if cls.__module__.startswith("lightning_gradcomp.")}
    covered = {type(_build(path)).name for path in PRESETS}
    assert ours - covered == set()
