"""The release a user installs: the wheel holds every package of the code and the presets, and from an
install of it, outside the checkout, ``gradcomp presets`` and the quick start run."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_gradcomp

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess  # builds a wheel and runs the CLI in processes of its own


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel built from the checkout, and a folder it is installed into (without its dependencies,
    which this environment has)."""
    folder = tmp_path_factory.mktemp("release")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(folder / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (folder / "dist").glob("lightning_gradcomp-*.whl")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                              str(folder / "site"), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    return wheel, folder / "site"


def test_the_wheel_holds_every_package_and_the_presets(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(path.parent.relative_to(ROOT)) for path in (ROOT / "lightning_gradcomp").rglob("__init__.py")}
    assert all(f"{package}/__init__.py" in names for package in packages), sorted(packages)
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "lightning_gradcomp").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    presets = {f"lightning_gradcomp/_presets/{path.relative_to(ROOT)}" for kind in ("configs", "recipes")
               for path in (ROOT / kind).rglob("*.yaml")}
    assert presets and presets <= names, sorted(presets - names)
    assert f"lightning_gradcomp-{lightning_gradcomp.__version__}.dist-info/METADATA" in names


def test_the_installed_cli_runs_the_quick_start_outside_the_checkout(installed: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    _, site = installed
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    listing = subprocess.run([sys.executable, "-m", "lightning_gradcomp", "presets"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert f"presets in {site / 'lightning_gradcomp' / '_presets'}" in listing.stdout
    assert "recipes/quickstart_digits.yaml" in listing.stdout
    run = subprocess.run([sys.executable, "-m", "lightning_gradcomp", "fit", "--config", "quickstart_digits.yaml",
                          "--trainer.devices=1", "--trainer.fast_dev_run=true", "--trainer.logger=false"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "gradcomp summary" in run.stdout, run.stdout[-2000:]
