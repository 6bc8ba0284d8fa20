"""Local updates on FSDP2 shards (``local_updates(..., mesh=mesh)``): 2 replicas x 2 shards on gloo."""

from __future__ import annotations

import pytest

from tests._fsdp_local_workers import (
    check_a_non_finite_outer_gradient_is_skipped,
    check_every_method_equals_the_replicated_loop,
    check_one_step_windows_equal_compressed_hsdp,
    check_resume_views_sync_and_refusals,
)
from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_every_method_on_shards_equals_the_replicated_loop_and_holds_only_its_shard() -> None:
    run_gloo(check_every_method_equals_the_replicated_loop, 4)


def test_one_step_windows_equal_compressed_hsdp() -> None:
    run_gloo(check_one_step_windows_equal_compressed_hsdp, 4)


def test_resume_mid_window_views_sync_another_mesh_and_refusals() -> None:
    run_gloo(check_resume_views_sync_and_refusals, 4)


def test_a_non_finite_outer_gradient_is_skipped_on_every_rank() -> None:
    run_gloo(check_a_non_finite_outer_gradient_is_skipped, 4)
