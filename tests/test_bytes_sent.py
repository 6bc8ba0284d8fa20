"""One definition of the bytes a rank sends (``metrics.stats.collective_bytes_sent``): an all-reduce or an
all-gather sends its input, an all-to-all its rows for the other ranks (its own row never leaves the
process). The drivers, the simulation and the DDP hook count by it; a real gloo run's count equals the
bytes that leave the process, counted at torch.distributed, and the simulation's."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.exchange.drivers import InProcessDriver
from lightning_gradcomp.exchange.engine import Collective
from lightning_gradcomp.metrics.stats import collective_bytes_sent, logged_bytes_sent
from tests._processes import run_gloo

#: int8 codes and one fp32 scale per block of 256 elements against fp32: the format's ratio.
INT8_RATIO = 4 / (1 + 4 / 256)


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_an_all_reduce_and_an_all_gather_send_their_input_an_all_to_all_all_but_its_own_row(workers: int) -> None:
    rows = 1200 * workers
    assert collective_bytes_sent("all_reduce", 4096, workers) == 4096
    assert collective_bytes_sent("all_gather", 4096, workers) == 4096
    assert collective_bytes_sent("all_to_all", rows, workers) == rows // workers * (workers - 1)


@pytest.mark.parametrize("kind, nbytes, workers, message", [
    ("broadcast", 8, 2, "`kind` must be one of all_reduce, all_gather, all_to_all"),
    ("all_to_all", 9, 2, "an all_to_all's input is 2 equal rows; got 9 bytes"),
    ("all_reduce", -1, 2, "`input_bytes` must be an integer >= 0"),
    ("all_reduce", 8, 0, "`world_size` must be an integer >= 1"),
])
def test_bad_collectives_are_refused_by_name(kind: str, nbytes: int, workers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        collective_bytes_sent(kind, nbytes, workers)


def test_a_log_counts_what_leaves_the_node_and_refuses_unknown_scopes() -> None:
    log = [("node:all_reduce", 4000), ("cross:all_to_all", 3000), ("cross:all_gather", 500), ("node:all_reduce", 4000)]
    assert logged_bytes_sent(log, 3) == 2000 + 500  # inside a node: not counted; among 3 nodes: 2 rows of 3
    assert logged_bytes_sent([("all_reduce", 40), ("all_to_all", 40)], 4) == 40 + 30
    with pytest.raises(ValueError, match="scope must be one of"):
        logged_bytes_sent([("rack:all_reduce", 8)], 2)


def test_the_in_process_driver_counts_each_worker_by_the_definition_and_logs_inputs() -> None:
    driver = InProcessDriver(4)
    for counter in driver.counters:
        counter.count(Collective("all_to_all", torch.zeros(4, 100)), 4)  # 1600 bytes, 400 of them this row
        counter.count(Collective("all_gather", torch.zeros(100)), 4)
    assert [counter.bytes_sent for counter in driver.counters] == [1200 + 400] * 4
    assert driver.counters[0].take_log() == [("all_to_all", 1600), ("all_gather", 400)]


def check_int8_counts_the_bytes_that_leave_the_rank(rank: int, world_size: int) -> None:
    """int8 and uncompressed in the real hook: the bytes counted equal the bytes that leave the process,
    counted at torch.distributed (an all-to-all's own row excluded), equal the simulation's, and int8's
    ratio against fp32 is its format's, 3.9x (counting the own row gave 2.6x at 2 workers)."""
    from lightning_gradcomp.compressors import Int8AllReduce, NoCompression
    from lightning_gradcomp.ddp.hook import GradCompHookState
    from lightning_gradcomp.simulation import SimulatedExchange
    from tests._gloo_workers import CollectiveSpy, _exchange

    param = torch.empty(64, 1024)

    def grad(worker: int) -> torch.Tensor:
        return torch.randn(64, 1024, generator=torch.Generator().manual_seed(worker))

    sent = {}
    for make in (Int8AllReduce, NoCompression):
        state = GradCompHookState(make(), {id(param): "w"}, min_compress_numel=1024)
        with CollectiveSpy() as spy:
            _exchange(state, [param], [grad(rank)])
        stats = state.take_step_stats()
        assert stats.bytes_sent == spy.bytes == state.driver.bytes_sent, (make, stats, spy.calls)
        simulation = SimulatedExchange(make(), world_size, min_compress_numel=1024)
        for worker in range(world_size):
            simulation.add_worker(worker, [("w", grad(worker))])
        simulation.finish_step()
        assert simulation.step_stats.bytes_sent == stats.bytes_sent, (make, simulation.step_stats, stats)
        assert simulation.step_stats.collectives == stats.collectives
        sent[make.name] = stats
    int8, dense = sent["int8"], sent["none"]
    assert dense.bytes_sent == 4 * param.numel() + 4  # fp32 and the bucket's finiteness flag
    assert int8.compression_ratio == pytest.approx(INT8_RATIO, rel=0.01)  # chunks padded at 3 workers
    assert dense.bytes_sent / int8.bytes_sent == pytest.approx(int8.compression_ratio, rel=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_real_int8_counts_what_leaves_the_rank_like_the_simulation(world_size: int) -> None:
    run_gloo(check_int8_counts_the_bytes_that_leave_the_rank, world_size)
