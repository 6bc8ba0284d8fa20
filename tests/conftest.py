"""Shared fixtures: memoised real multi-process Lightning and Fabric runs (the helpers themselves are in
tests/_processes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests._processes import run_lightning


def _memoised_runs(root: Path, script: str) -> Callable[..., tuple[list[dict], str]]:
    cache: dict[tuple[str, ...], tuple[list[dict], str]] = {}

    def run(name: str, *args: str) -> tuple[list[dict], str]:
        key = (name, *args)
        if key not in cache:
            cache[key] = run_lightning(root, name, *args, script=script)
        return cache[key]

    run.root = root  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="session")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[list[dict], str]]:
    """Memoised :func:`run_lightning` of ``train_digits.py``: runs shared by several tests happen once."""
    return _memoised_runs(tmp_path_factory.mktemp("lightning"), "train_digits.py")


@pytest.fixture(scope="session")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[list[dict], str]]:
    """Memoised real 2-process Fabric runs of ``fabric_digits.py``."""
    return _memoised_runs(tmp_path_factory.mktemp("fabric"), "fabric_digits.py")
