"""LitGPT's ``GPT`` trained as its users train it (issue 49): ``examples/litgpt_pretrain.py``, a Fabric loop
with LitGPT's model, initialisation and chunked loss, AdamW, clipping, in-loop evaluation and
``fabric.save``/``load``, run as real multi-process Fabric jobs through gradcomp's Fabric strategies:
compressed DDP (2 ranks), compressed HSDP (2 replicas x 2 shards), DiLoCo and SparseLoCo (2 ranks).
Replicas end equal, an evaluation mid-window sees ``θ_global``, a run resumed from a checkpoint written
mid-run (mid-window under local updates), each rank reading its own part of the exchange state, ends bit for
bit where the uninterrupted one does.

Skipped where ``litgpt`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._processes import run_job

pytest.importorskip("litgpt")
pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).parents[1] / "examples" / "litgpt_pretrain.py"
DOCS = Path(__file__).parents[1] / "docs"
#: 14 steps, checkpoints and evaluations at steps 6 and 12; local updates every 4 steps (steps 6 and 14 are
#: mid-window: the resume, and the evaluation view the example reports before its final sync())
COMMON = ["--accelerator", "cpu", "--steps", "14", "--save-every", "6", "--eval-every", "6", "--sync-every", "4",
          "--data", str(DOCS)]


def _run(tmp_path: Path, name: str, mode: str, devices: int, *args: str) -> tuple[list[dict], str]:
    """The example as ``devices`` processes of one job (forked from the fork server, as a launcher starts them;
    Fabric then starts none of its own)."""
    report = tmp_path / name
    codes, output = run_job(EXAMPLE, ["--mode", mode, "--devices", str(devices), *COMMON, "--out-dir",
                                      str(tmp_path / f"out-{mode}"), "--report", str(report), *args],
                            tmp_path, devices, timeout=300)
    assert all(code == 0 for code in codes), output[-4000:]
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


def test_compressed_ddp_int8_resumes_exactly(tmp_path: Path) -> None:
    ranks, output = _run(tmp_path, "ddp", "ddp", 2)
    assert _equal(ranks[0]["params"], ranks[1]["params"])
    totals = ranks[0]["totals"]
    assert 3.5 < totals["bytes_dense"] / totals["bytes_sent"] < 4.0  # int8 with per-block scales
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    assert "gradcomp summary" in output
    parts = tmp_path / "out-ddp" / "step-000006.ckpt.gradcomp"
    assert sorted(p.name for p in parts.iterdir()) == ["rank00000.pt", "rank00001.pt"]  # beside the file
    _assert_resumes_exactly(tmp_path, "ddp", 2, ranks)


def test_compressed_hsdp_two_replicas_of_two_shards_resumes_exactly(tmp_path: Path) -> None:
    ranks, _ = _run(tmp_path, "hsdp", "hsdp", 4)
    for shard in (0, 1):  # the ranks holding the same shard in the two replicas
        assert _equal(ranks[shard]["params"], ranks[shard + 2]["params"]), shard
    assert not _equal(ranks[0]["params"], ranks[1]["params"])  # sharded: each rank its own part
    checkpoint = tmp_path / "out-hsdp" / "step-000006.ckpt"
    assert checkpoint.is_dir() and len(list((checkpoint / "gradcomp").glob("rank*.pt"))) == 4  # each rank its part
    _assert_resumes_exactly(tmp_path, "hsdp", 4, ranks)


def _assert_local_updates(ranks: list[dict]) -> None:
    assert _equal(ranks[0]["params"], ranks[1]["params"])  # the final sync(): every rank on θ_global
    for rank in ranks:  # step 14 of windows of 4: the evaluation saw θ_global, not the rank's replica
        assert rank["evaluation_view"] == {"equals_global": True, "equals_replica": False}


def test_diloco_resumes_mid_window_exactly(tmp_path: Path) -> None:
    ranks, output = _run(tmp_path, "diloco", "diloco", 2)
    _assert_local_updates(ranks)
    assert "4 synchronisations in 14 optimizer steps" in output  # 3 windows, and the final sync() of 2 steps
    _assert_resumes_exactly(tmp_path, "diloco", 2, ranks)


def test_sparseloco_resumes_mid_window_exactly(tmp_path: Path) -> None:
    ranks, _ = _run(tmp_path, "sparseloco", "sparseloco", 2)
    _assert_local_updates(ranks)
    totals = ranks[0]["totals"]
    assert totals["bytes_dense"] / totals["bytes_sent"] > 30  # 64 of every 4096 entries, 2-bit values
    _assert_resumes_exactly(tmp_path, "sparseloco", 2, ranks)
