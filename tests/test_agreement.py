"""Ranks that disagree on what shapes the wire: an error on every rank at registration, never a hang, an
abort or a silent mix (lightning_gradcomp/exchange/agreement.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_gradcomp.exchange.agreement import (
    describe_mismatch,
    describe_optimizer_factory,
    fingerprint,
)
from lightning_gradcomp.local.config import LocalUpdates, diloco_outer_optimizer

from tests._processes import run_gloo


def test_the_fingerprint_depends_on_every_name_and_value_and_not_on_order() -> None:
    settings = {"compressor": "TopK(density=0.01)", "seed": "0"}
    assert fingerprint(settings) == fingerprint(dict(reversed(settings.items())))
    assert fingerprint(settings) != fingerprint({**settings, "seed": "1"})
    assert fingerprint(settings) != fingerprint({"compressor": "TopK(density=0.01)"})
    assert 0 <= fingerprint(settings) < 2**63  # fits a signed 64-bit tensor


def test_the_message_names_each_differing_setting_and_every_ranks_value() -> None:
    message = describe_mismatch([{"compressor": "TopK(density=0.01)", "seed": "0"},
                                 {"compressor": "TopK(density=0.5)", "seed": "0"},
                                 {"compressor": "TopK(density=0.01)", "seed": "0", "extra": "x" * 500}], "register()")
    assert "register()" in message
    assert "`compressor`: TopK(density=0.01) on ranks 0, 2; TopK(density=0.5) on rank 1" in message
    assert "`seed`" not in message
    assert "`extra`: (not set) on ranks 0, 1; " in message and "(500 characters)" in message


def test_outer_optimizers_are_described_by_what_they_build_never_by_an_address() -> None:
    assert describe_optimizer_factory(functools.partial(torch.optim.SGD, lr=1.0)) == "torch.optim.sgd.SGD(lr=1.0)"
    assert describe_optimizer_factory(diloco_outer_optimizer).endswith("config.diloco_outer_optimizer")
    assert "0x" not in describe_optimizer_factory(lambda params: torch.optim.SGD(params, lr=1.0))
    assert LocalUpdates(4, fragments=2).settings()["fragments"] == "2"
    assert LocalUpdates(4, fragments=[["a"], ["b", torch.nn.Linear(1, 1)]]).settings()["fragments"] == \
        "[['a'], ['b', 'Linear']]"


@pytest.mark.multiprocess
def test_every_entry_point_refuses_settings_that_differ_between_ranks_on_every_rank() -> None:
    """register() (density, method, min_compress_numel, seed, error feedback), local_updates() (compressor,
    H, fragments, outer optimizer), register_fsdp() and local_updates(mesh=) on a 2 x 1 mesh: each raises
    SettingsMismatch on both ranks, naming the setting and both values; then equal settings pass."""
    run_gloo(_workers().check_every_mismatch_is_an_error_on_every_rank, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("delay", [0, 1])
def test_a_rank_that_synchronises_alone_is_an_error_on_every_rank(delay: int) -> None:
    """Local updates: a rank that calls sync() alone mid-window is caught at the next synchronisation of
    the others (the inner step differs), on every rank, before any payload moves; without delay and with an
    overlapped exchange."""
    run_gloo(_workers().check_a_rank_out_of_step_is_an_error_on_every_rank, 2, delay)


@pytest.mark.multiprocess
def test_a_second_exchange_on_one_model_is_refused_until_the_first_is_closed() -> None:
    """register_fsdp twice, local_updates after register_fsdp (local updates silently defeated before),
    local_updates twice (two θ_global), register() after local_updates: each refused; after close() allowed."""
    run_gloo(_workers().check_a_second_exchange_on_one_model_is_refused, 2)


@pytest.mark.multiprocess
def test_fsdp2_pitfalls_are_caught_or_work() -> None:
    """An optimizer built before fully_shard (it holds the replaced parameters: nothing would train) is
    refused under register_fsdp and local_updates(mesh=), an optimizer of another model too; model.to()
    after register_fsdp works; a model cast to another dtype after local_updates() is refused at its first
    synchronisation."""
    run_gloo(_workers().check_fsdp2_pitfalls_are_caught, 2)


def _workers():  # noqa: ANN202 - imported late: FSDP2's import is not needed by the single-process tests
    from tests import _agreement_workers

    return _agreement_workers


def test_the_ranks_out_of_step_are_those_off_the_majority_or_all() -> None:
    from lightning_gradcomp.exchange.agreement import out_of_step

    assert out_of_step([(4, 0, 10), (4, 0, 10), (2, 0, 10)]) == [2]
    assert out_of_step([(4, 0, 10), (2, 0, 10)]) == [0, 1]
    assert out_of_step([(4, 0, 10)] * 3) == []


# A rank that never registers, summarises or synchronises: the misuse probe's "never calls" / "only" cases
# (tests/_misuse_cases.py) check that the waiting rank raises WaitTimeout naming the call and the absent rank.


@pytest.mark.parametrize("value", ["0", "-3", "nan", "soon"])
def test_a_bad_wait_bound_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from lightning_gradcomp.exchange.waits import wait_timeout_s

    monkeypatch.setenv("GRADCOMP_WAIT_TIMEOUT", value)
    with pytest.raises(ValueError, match="GRADCOMP_WAIT_TIMEOUT must be a positive number of seconds"):
        wait_timeout_s()
    monkeypatch.setenv("GRADCOMP_WAIT_TIMEOUT", "2.5")
    assert wait_timeout_s() == 2.5


def test_no_quorum_says_whether_the_lighthouse_answers() -> None:
    """One group under a lighthouse of --min_replicas 2 is told that too few groups joined (it used to be
    asked whether the lighthouse runs); an address where nothing listens is told to start one."""
    import socket

    from lightning_gradcomp.local.fault_tolerance import FaultTolerance, describe_no_quorum

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        answering = FaultTolerance(lighthouse=f"http://127.0.0.1:{listening.getsockname()[1]}", quorum_timeout=2)
        message = describe_no_quorum(answering, TimeoutError("Timeout expired"))
        closed_port = listening.getsockname()[1]
    assert "though the lighthouse answers" in message and "--min_replicas" in message and "quorum_timeout" in message
    silent = describe_no_quorum(FaultTolerance(lighthouse=f"http://127.0.0.1:{closed_port}"), TimeoutError("x"))
    assert "nothing answers at that address" in silent and "torchft_lighthouse --min_replicas 1" in silent
