"""What keeps the exchange safe on GPUs, checked on the CPU (issue 40): tensors handed to the exchange
stream are recorded on it, the exchange thread sets its device before it touches a stream, the ordering
rule of two process groups, fp32 products and no autocast inside the exchange, the dependency floor.

The CUDA twins of these checks are in tests/test_cuda.py (skipped without a GPU)."""

from __future__ import annotations

import re
import threading
import tomllib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lightning_gradcomp.compressors import DeMo, PowerSGD
from lightning_gradcomp.core import device as device_module
from lightning_gradcomp.core.device import full_precision_matmuls, on_stream
from lightning_gradcomp.exchange import thread as thread_module
from lightning_gradcomp.exchange.engine import BucketReport
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.exchange.thread import (
    check_concurrent_communicators,
    concurrent_communicators_allowed,
    ExchangeThread,
)

from tests._processes import run_gloo


class _FakeStream:
    """Stands for a CUDA stream on a machine without one: records what the exchange does with it."""

    def __init__(self, log: list[str]) -> None:
        self.device = torch.device("cuda", 1)
        self.log = log

    def wait_event(self, event: object) -> None:
        self.log.append("wait_event")


class _FakeStreams:
    def __init__(self, stream: _FakeStream) -> None:
        self.stream = stream

    def get(self, device: torch.device) -> _FakeStream:
        return self.stream


class _FakeDriver:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def drive(self, protocol: object) -> BucketReport:
        self.log.append("drive")
        return BucketReport(0, 0, 0)


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``torch.cuda.device`` and ``torch.cuda.stream`` replaced by context managers that log their use."""
    log: list[str] = []

    @contextmanager
    def device(where: torch.device) -> Iterator[None]:
        log.append(f"device {where}")
        yield
        log.append("device exit")

    @contextmanager
    def stream(which: _FakeStream) -> Iterator[None]:
        assert log and log[-1].startswith("device"), "a stream was made current before its device"
        log.append("stream")
        yield
        log.append("stream exit")

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log


def test_a_stream_is_entered_with_its_device_current(cuda_calls: list[str]) -> None:
    stream = _FakeStream(cuda_calls)
    with on_stream(stream):
        cuda_calls.append("work")
    assert cuda_calls == ["device cuda:1", "stream", "work", "stream exit", "device exit"]
    cuda_calls.clear()
    with on_stream(None):
        pass
    assert cuda_calls == []


def test_the_exchange_thread_sets_its_device_then_records_the_handed_tensors_then_exchanges(
        cuda_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 2: the thread makes the stream's device current before it touches the stream (a new thread's
    device is 0: a context on another rank's GPU otherwise). Item 1: the tensors the caller allocated are
    recorded on the exchange stream before the exchange runs."""
    handed_over: list[tuple[list[torch.Tensor], object]] = []

    def hand_over(tensors, stream):  # noqa: ANN001
        cuda_calls.append("hand_over")
        handed_over.append((list(tensors), stream))

    monkeypatch.setattr(thread_module, "hand_over", hand_over)
    stream = _FakeStream(cuda_calls)
    exchange = ExchangeThread(_FakeDriver(cuda_calls), _FakeStreams(stream))
    tensors = [torch.ones(3), torch.zeros(2)]
    try:
        value = exchange.submit(iter(()), torch.device("cpu"), lambda report: "finished", tensors).wait()
    finally:
        exchange.close()
    assert value == "finished"
    assert cuda_calls == ["device cuda:1", "stream", "wait_event", "hand_over", "drive", "stream exit", "device exit"]
    assert handed_over[0][1] is stream and [id(t) for t in handed_over[0][0]] == [id(t) for t in tensors]


def test_hand_over_records_cuda_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[tuple[object, object]] = []
    monkeypatch.setattr(thread_module, "_record_stream", lambda tensor, stream: recorded.append((tensor, stream)))
    stream = object()
    thread_module.hand_over([torch.ones(2), None], stream)  # CPU tensors need no record
    assert recorded == []
    thread_module.hand_over([torch.ones(2, device="meta")], None)
    assert recorded == []


@pytest.mark.multiprocess
def test_an_overlapped_exchange_hands_over_its_inputs_and_outputs_and_returns_the_outputs() -> None:
    from tests._stream_workers import check_overlapped_exchange_hands_over_its_tensors

    run_gloo(check_overlapped_exchange_hands_over_its_tensors, 1)


# ---------------------------------------------------------------- item 3: the ordering rule
def test_nccl_with_one_hardware_queue_refuses_the_exchange_thread() -> None:
    assert concurrent_communicators_allowed("gloo", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert concurrent_communicators_allowed("nccl", {})
    assert concurrent_communicators_allowed("nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert not concurrent_communicators_allowed("nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    with pytest.raises(ValueError, match=r"CUDA_DEVICE_MAX_CONNECTIONS=1 can deadlock.*Allowed: unset"):
        check_concurrent_communicators("nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": " 1 "})
    check_concurrent_communicators("gloo", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def test_the_exchange_group_creates_its_nccl_communicator_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL creates a communicator at its first collective: that must not be on the exchange thread."""
    created, initialised = object(), []
    monkeypatch.setattr(thread_module.dist, "new_group", lambda *args, **kwargs: created)
    monkeypatch.setattr(thread_module, "group_timeout", lambda group: None)
    monkeypatch.setattr(thread_module, "eager_init", lambda group, device: initialised.append((group, device)))
    for backend, expected in (("gloo", []), ("nccl", [(created, torch.device("cuda", 0))])):
        initialised.clear()
        monkeypatch.setattr(thread_module.dist, "get_backend", lambda group=None, backend=backend: backend)
        assert thread_module.exchange_group(None, torch.device("cuda", 0)) is created
        assert initialised == expected, backend


@pytest.mark.multiprocess
def test_the_exchange_thread_is_refused_or_left_off_on_nccl_with_one_hardware_queue() -> None:
    from tests._stream_workers import check_thread_refused_on_nccl_with_one_hardware_queue

    run_gloo(check_thread_refused_on_nccl_with_one_hardware_queue, 1)


@pytest.mark.multiprocess
def test_overlapped_local_updates_beside_the_training_groups_collectives() -> None:
    from tests._stream_workers import check_overlapped_local_updates_beside_training_collectives

    run_gloo(check_overlapped_local_updates_beside_training_collectives, 2)


# ---------------------------------------------------------------- item 6: fp32 products, no autocast
def _exchange(compressor, precision: str = "highest", autocast: bool = False) -> list[torch.Tensor]:
    """Two simulated workers, three steps of a bucket of two matrices and a bias; the averaged results."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        exchange = SimulatedExchange(compressor, 2, min_compress_numel=100)
        generator = torch.Generator().manual_seed(5)
        outs = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                for worker in range(2):
                    exchange.add_worker(worker, [("a", torch.randn(96, 80, generator=generator)),
                                                 ("b", torch.randn(64, 64, generator=generator)),
                                                 ("c", torch.randn(64, generator=generator))])
                outs.append(exchange.finish_step())
        return [tensor for step in outs for tensor in step.values()]
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: DeMo(chunk=16, k=8, decay=0.95, sign=False)],
                         ids=["powersgd", "demo"])
def test_reduced_precision_products_and_autocast_do_not_reach_the_exchange(make) -> None:
    """``set_float32_matmul_precision("medium")`` (on the CPU: bf16 products in oneDNN, as ``"high"`` gives
    TF32 on CUDA) and a user's autocast around backward leave PowerSGD's and DeMo's results bit for bit
    what they are in full precision, and the user's setting as it was."""
    reference = _exchange(make())
    for precision, autocast in (("medium", False), ("highest", True), ("medium", True)):
        got = _exchange(make(), precision, autocast)
        assert all(torch.equal(a, b) for a, b in zip(reference, got)), (precision, autocast)
    torch.set_float32_matmul_precision("medium")
    try:
        with full_precision_matmuls():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")


def test_full_precision_products_nest_across_threads() -> None:
    """The setting is restored when the last of several threads inside leaves, not before."""
    torch.set_float32_matmul_precision("high")
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with full_precision_matmuls():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=other)
    try:
        worker.start()
        inside.wait(10)
        with full_precision_matmuls():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "highest"  # the other thread is still inside
        leave.set()
        worker.join(10)
        assert torch.get_float32_matmul_precision() == "high"
        assert device_module._matmul_depth == 0
    finally:
        leave.set()
        torch.set_float32_matmul_precision("highest")


# ---------------------------------------------------------------- item 5: the dependency floor
def test_torch_floor_is_2_4_where_cuda_index_put_accumulate_reads_nothing_on_the_host() -> None:
    """Before 2.4, CUDA ``index_put_(accumulate=True)`` read its index's min and max on the host (PyTorch
    #125952): two synchronisations per call in every sparse decode."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (torch_requirement,) = [r for r in project["project"]["dependencies"] if re.match(r"torch\b", r)]
    floor = re.search(r">=\s*([\d.]+)", torch_requirement)
    assert floor is not None, torch_requirement
    assert tuple(int(part) for part in floor.group(1).split(".")[:2]) >= (2, 4), torch_requirement
