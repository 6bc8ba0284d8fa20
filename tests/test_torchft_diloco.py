"""Our uncompressed DiLoCo on FSDP2 shards against torchft's ``DiLoCo`` (skipped without torchft, the ``ft``
extra): the same model, data, inner and outer optimizers, 2 replica groups x 2 shards."""

from __future__ import annotations

import pytest

from tests._processes import free_port, run_processes
from tests._torchft_workers import (
    check_ddp_groups_split_the_exchange,
    check_diloco_equals_torchft,
    check_fault_tolerant_shards_equal_the_mesh,
    check_streaming_groups_equal_the_world,
)

pytestmark = pytest.mark.multiprocess


def test_sharded_diloco_equals_torchft_diloco() -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        run_processes(check_diloco_equals_torchft, 4, [free_port() for _ in range(3)], lighthouse.address())
    finally:
        lighthouse.shutdown()


def test_fault_tolerant_replica_groups_of_fsdp2_shards_equal_the_mesh() -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000)
    try:
        run_processes(check_fault_tolerant_shards_equal_the_mesh, 4, [free_port() for _ in range(3)],
                      lighthouse.address())
    finally:
        lighthouse.shutdown()


def test_fault_tolerant_replica_groups_of_ddp_processes_split_the_exchange() -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouses = [LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000) for _ in range(2)]
    try:
        run_processes(check_ddp_groups_split_the_exchange, 4, [free_port() for _ in range(9)],
                      *[lighthouse.address() for lighthouse in lighthouses])
    finally:
        for lighthouse in lighthouses:
            lighthouse.shutdown()


def test_streaming_diloco_under_fault_tolerance_equals_it_without() -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000)
    try:
        run_processes(check_streaming_groups_equal_the_world, 2, [free_port() for _ in range(3)], lighthouse.address())
    finally:
        lighthouse.shutdown()
