"""The hierarchical exchange (compress only what crosses between nodes): 2 "nodes" x 2 real processes."""

from __future__ import annotations

import pytest

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.ddp.hierarchy import partition
from lightning_gradcomp.exchange.checkpoint import gather_parts
from lightning_gradcomp.metrics.netmodel import Network
from tests._processes import run_gloo


def test_partition_balances_sizes_and_is_deterministic() -> None:
    items, sizes = list("abcdef"), [100, 10, 60, 50, 5, 40]
    shares = partition(items, sizes, 2)
    assert shares == partition(items, sizes, 2)
    assert sorted(sum(shares, [])) == items, "every item has exactly one owner"
    assert shares == [["a", "f"], ["b", "c", "d", "e"]]  # largest first, each to the least loaded owner
    loads = [sum(sizes[items.index(i)] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes)
    assert partition(items, sizes, 8)[7] == [] and partition([], [], 3) == [[], [], []]


def test_network_prices_node_and_cross_scopes_on_their_own_links() -> None:
    network = Network(bandwidth_gbps=1, latency_us=50, local_size=4, intra_bandwidth_gbps=100, intra_latency_us=5)
    nbytes, workers = 4e6, 16
    assert network.time("node:all_reduce", nbytes, workers) == pytest.approx(network.intra_node().all_reduce_time(nbytes, 4))
    shared = Network(bandwidth_gbps=0.25, latency_us=50)  # the node's 4 cross-node groups share its link
    assert network.time("cross:all_gather", nbytes, workers) == pytest.approx(shared.all_gather_time(nbytes, 4))
    assert network.time("all_gather", nbytes, workers) == pytest.approx(network.all_gather_time(nbytes, 16))
    assert network.time("node:all_reduce", nbytes, workers) < network.time("cross:all_reduce", nbytes, workers) / 50
    with pytest.raises(ValueError, match="`local_size` must be an integer >= 1"):
        Network(local_size=0)
    with pytest.raises(ValueError, match="scope must be 'node' or 'cross'"):
        network.time("rack:all_reduce", 1.0, 4)


@pytest.mark.multiprocess
def test_every_compressor_runs_hierarchically_like_the_simulation() -> None:
    from tests._gloo_workers import check_hierarchical_equals_simulated

    run_gloo(check_hierarchical_equals_simulated, 4, sorted(COMPRESSORS))


@pytest.mark.multiprocess
def test_lightning_two_nodes_of_two_processes_train_hierarchically(tmp_path) -> None:
    """Two "nodes" (Lightning's launcher started once per node, NODE_RANK 0 and 1) of 2 CPU processes:
    the groups come from Lightning's cluster environment, every rank ends with the same parameters, and
    the checkpoint holds the 4 ranks' states under the hierarchical layout."""
    import os

    import torch

    from tests._processes import SCRIPTS, ScriptRun, free_port

    port = str(free_port())
    ckpt = tmp_path / "hier.ckpt"
    args = ["--out", str(tmp_path / "hier"), "--num-nodes", "2", "--hierarchy", "node", "--compressor", "topk",
            "--epochs", "2", "--save", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    nodes = [ScriptRun(SCRIPTS / "train_digits.py", args, tmp_path, dict(env, NODE_RANK=str(node))) for node in range(2)]
    try:
        finished = [node.wait(timeout=400) for node in nodes]
    finally:
        for node in nodes:  # a node left waiting for a failed one
            node.kill()
    assert all(code == 0 for code, _ in finished), "\n".join(output[-3000:] for _, output in finished)
    ranks = [torch.load(tmp_path / f"hier.rank{rank}.pt", weights_only=False) for rank in range(4)]
    steps = 2 * 11  # 1348 training images / 4 ranks / batch 32, rounded up
    for result in ranks:
        assert result["world_size"] == 4 and result["global_step"] == result["hook_step"] == steps
        assert all(torch.equal(result["params"][k], ranks[0]["params"][k]) for k in result["params"])
        assert all(s["bytes_sent"] < s["bytes_dense"] / 25 for s in result["steps"]), "only shares cross nodes"
    assert torch.load(ckpt, weights_only=True)["gradcomp"]["parts"] == 4  # each rank wrote its own part
    saved = gather_parts(ckpt)
    assert saved["layout"] == "nodes=2,local=2" and saved["world_size"] == 4 and len(saved["ranks"]) == 4
    owned = [set(rank["memory"]["residuals"]) for rank in saved["ranks"]]
    assert owned[0] == owned[2] and owned[1] == owned[3] and not owned[0] & owned[1], \
        "local rank l of every node owns the same parameters, and no parameter has two owners in a node"


def test_simulation_models_nodes_of_workers(tmp_path) -> None:
    import lightning as L

    from lightning_gradcomp import GradCompSimStrategy
    from lightning_gradcomp.callbacks import CompressionMonitor
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    strategy = GradCompSimStrategy(workers=4, hierarchy="node", nodes=2, compressor="topk", print_summary=False)
    monitor = CompressionMonitor(network=Network(bandwidth_gbps=1, local_size=2, intra_bandwidth_gbps=100))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=strategy, callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(batch_size=64))
    exchange = strategy.hook_state
    assert (exchange.workers, exchange.local_size, exchange.layout) == (2, 2, "nodes=2,local=2,simulated")
    stats = strategy.step_stats
    assert [kind for kind, _ in stats.collectives[:2]] == ["node:all_reduce", "node:all_reduce"]
    assert all(kind.startswith("cross:") for kind, _ in stats.collectives[2:])
    assert stats.bytes_sent < stats.bytes_dense / 25
    with pytest.raises(ValueError, match="`nodes` must divide `workers`"):
        GradCompSimStrategy(workers=4, hierarchy="node", nodes=3)
    with pytest.raises(ValueError, match="`hierarchy` must be 'none' or 'node'"):
        GradCompSimStrategy(hierarchy="rack")
