"""The raw hook and ``register()`` in real gloo processes: bounded per-step state, clear refusals."""

from __future__ import annotations

import pytest

from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_the_raw_hook_keeps_no_more_than_one_step_of_figures() -> None:
    from tests._raw_hook_workers import check_the_raw_hook_keeps_one_step

    run_gloo(check_the_raw_hook_keeps_one_step, 2, 40)


def test_register_refuses_what_it_cannot_run_with_a_clear_message() -> None:
    from tests._raw_hook_workers import check_register_refuses_what_it_cannot_run

    run_gloo(check_register_refuses_what_it_cannot_run, 2)


def test_the_summary_and_counters_span_every_step_and_survive_a_resume_with_another_compressor() -> None:
    from tests._raw_hook_workers import check_summary_and_counters_span_every_step

    run_gloo(check_summary_and_counters_span_every_step, 2)


@pytest.mark.multiprocess
def test_register_refuses_a_second_hook_and_sharded_models_and_switches_compressors() -> None:
    from tests._raw_hook_workers import check_register_refuses_sharded_and_second_registrations

    run_gloo(check_register_refuses_sharded_and_second_registrations, 1)
