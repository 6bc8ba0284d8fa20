"""The exchange thread's collectives never interleave with other collectives of the training's group."""

from __future__ import annotations

import pytest

from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_the_exchange_thread_beside_unused_parameters_and_a_collective_in_backward() -> None:
    from tests._thread_workers import check_thread_beside_other_collectives

    run_gloo(check_thread_beside_other_collectives, 2)
