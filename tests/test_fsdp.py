"""Compressed HSDP (``register_fsdp``): FSDP2 inside a replica on gloo, the exchange between replicas."""

from __future__ import annotations

import pytest

from tests._fsdp_workers import (
    check_refusals_and_a_non_finite_shard,
    check_steps_settings_and_mesh_changes,
    check_two_replicas_of_one_shard,
    check_bytes_accumulation_bf16_and_resume,
    check_every_compressor_against_the_oracle,
    check_no_host_reads_in_the_fsdp_hook,
    check_none_equals_native_hsdp,
)
from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_uncompressed_equals_native_hsdp() -> None:
    run_gloo(check_none_equals_native_hsdp, 4)


def test_every_compressor_on_shards_equals_the_in_process_exchange() -> None:
    run_gloo(check_every_compressor_against_the_oracle, 4)


def test_bytes_accumulation_bf16_residuals_and_exact_resume() -> None:
    run_gloo(check_bytes_accumulation_bf16_and_resume, 4)


def test_bad_meshes_and_modules_are_refused_and_a_non_finite_shard_is_nan_everywhere() -> None:
    run_gloo(check_refusals_and_a_non_finite_shard, 4)


def test_no_host_reads_in_the_hook_along_the_accelerator_path() -> None:
    run_gloo(check_no_host_reads_in_the_fsdp_hook, 4)


def test_steps_end_with_their_backward_settings_refused_and_another_mesh_drops_residuals() -> None:
    """Review of issue 37: the step count drifted when a group was not reduced in a step, unsharded
    parameters and a divide factor were accepted silently, and a resume on another split kept residuals."""
    run_gloo(check_steps_settings_and_mesh_changes, 4)


def test_two_replicas_of_one_shard() -> None:
    run_gloo(check_two_replicas_of_one_shard, 2)
