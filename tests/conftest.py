"""Shared fixtures: memoised real multi-process Lightning and Fabric runs (the helpers themselves are in
tests/_processes.py)."""

from __future__ import annotations

import os

# MKL's matrix products depend on the memory alignment of their operands unless its strict conditional
# numerical reproducibility is on: two ranks multiplying the same matrices (PowerSGD's P·Qᵀ) may then
# round differently, and the tests compare ranks bit for bit. Set before torch loads MKL, inherited by
# the fork server and every process the tests start.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from pathlib import Path  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from tests._processes import run_lightning  # noqa: E402


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


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Each test leaves the environment as it found it: a Trainer fitted in this process sets ``MASTER_PORT``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ... in ``os.environ``, which a later test's scripts (started with this
    environment) would read as a launch of their own (and fail on a port in use)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
