"""The hook and transport in real 2-process gloo groups: counted bytes, averages, bucket ordering."""

from __future__ import annotations

import pytest

from tests import _gloo_workers as workers
from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_counted_bytes_equal_the_collective_inputs_and_results_are_averages() -> None:
    run_gloo(workers.check_counted_bytes_and_averages, 2)


def test_topk_at_density_001_reports_a_50x_ratio() -> None:
    run_gloo(workers.check_topk_ratio_is_fifty, 2)


def test_several_ddp_buckets_with_data_dependent_sizes_stay_in_sync() -> None:
    run_gloo(workers.check_multibucket_ddp_stays_in_sync, 2)
