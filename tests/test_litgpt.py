"""LitGPT's ``GPT`` trained as its users train it (issue 49): ``examples/litgpt_pretrain.py``, a Fabric loop
with LitGPT's model, initialisation and chunked loss, AdamW, clipping, in-loop evaluation and
``fabric.save``/``load``, run as real multi-process Fabric jobs through gradcomp's Fabric strategies:
compressed DDP (2 ranks), compressed HSDP (2 replicas x 2 shards), DiLoCo and SparseLoCo (2 ranks).
Replicas end equal, an evaluation mid-window sees ``θ_global``, a run resumed from a checkpoint written
mid-window (SparseLoCo) ends bit for bit where the uninterrupted one does.

Skipped where ``litgpt`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._processes import run_script

pytest.importorskip("litgpt")
pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parents[1] / "examples" / "litgpt_pretrain.py"
DOCS = Path(__file__).parents[1] / "docs"
#: 12 steps, checkpoint and evaluation at step 6; local updates every 4 steps (step 6 is mid-window)
COMMON = ["--accelerator", "cpu", "--steps", "12", "--save-every", "6", "--eval-every", "6", "--sync-every", "4",
          "--data", str(DOCS)]


def _run(tmp_path: Path, name: str, mode: str, devices: int, *args: str) -> tuple[list[dict], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    report = tmp_path / name
    code, output = run_script(EXAMPLE, ["--mode", mode, "--devices", str(devices), *COMMON, "--out-dir",
                                        str(tmp_path / f"out-{mode}"), "--report", str(report), *args],
                              tmp_path, env, timeout=300)
    assert code == 0, output[-4000:]
    return [torch.load(f"{report}.rank{rank}.pt", weights_only=False) for rank in range(devices)], output


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _assert_resumes_exactly(tmp_path: Path, mode: str, devices: int, whole: list[dict]) -> None:
    checkpoint = tmp_path / f"out-{mode}" / "step-000006.ckpt"
    resumed, _ = _run(tmp_path, f"{mode}-resumed", mode, devices, "--resume", str(checkpoint))
    for rank in range(devices):
        assert resumed[rank]["from_step"] == 6
        assert resumed[rank]["losses"] == whole[rank]["losses"][6:], rank
        assert _equal(resumed[rank]["params"], whole[rank]["params"]), rank


def test_compressed_ddp_int8(tmp_path: Path) -> None:
    ranks, output = _run(tmp_path, "ddp", "ddp", 2)
    assert _equal(ranks[0]["params"], ranks[1]["params"])
    totals = ranks[0]["totals"]
    assert 3.5 < totals["bytes_dense"] / totals["bytes_sent"] < 4.0  # int8 with per-block scales
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    assert "gradcomp summary" in output


def test_compressed_hsdp_two_replicas_of_two_shards(tmp_path: Path) -> None:
    ranks, _ = _run(tmp_path, "hsdp", "hsdp", 4)
    for shard in (0, 1):  # the ranks holding the same shard in the two replicas
        assert _equal(ranks[shard]["params"], ranks[shard + 2]["params"]), shard
    assert not _equal(ranks[0]["params"], ranks[1]["params"])  # sharded: each rank its own part
    assert (tmp_path / "out-hsdp" / "step-000006.ckpt").is_dir()  # a distributed checkpoint (resumed exactly in
    # test_lightning_fsdp's Fabric runs: not repeated here, 15 s of the suite)


def _assert_local_updates(ranks: list[dict]) -> None:
    assert _equal(ranks[0]["params"], ranks[1]["params"])  # the final sync(): every rank on θ_global
    for rank in ranks:  # step 6 of windows of 4: the evaluation saw θ_global, not the rank's replica
        assert rank["evaluation_view"] == {"equals_global": True, "equals_replica": False}


def test_diloco(tmp_path: Path) -> None:
    ranks, output = _run(tmp_path, "diloco", "diloco", 2)
    _assert_local_updates(ranks)
    assert "3 synchronisations in 12 optimizer steps" in output


def test_sparseloco_resumes_mid_window_exactly(tmp_path: Path) -> None:
    ranks, _ = _run(tmp_path, "sparseloco", "sparseloco", 2)
    _assert_local_updates(ranks)
    totals = ranks[0]["totals"]
    assert totals["bytes_dense"] / totals["bytes_sent"] > 30  # 64 of every 4096 entries, 2-bit values
    _assert_resumes_exactly(tmp_path, "sparseloco", 2, ranks)
