"""The DDP communication hook: a DDP bucket handed to the exchange session, driven by torch.distributed.

``model.register_comm_hook(GradCompHookState(compressor, names), gradcomp_hook)``

The hook turns the bucket into entries (each parameter's gradient view, which also receives the
aggregate), hands them to :meth:`~lightning_gradcomp.exchange.session.ExchangeSession.exchange`, and returns
a future of the bucket: the average over workers of the decoded exchange, as DDP's own all-reduce computes
it. Everything else (configuration, memory, thread, accounting) is the session's.
"""

from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.engine import Entry
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.session import ExchangeSession, exchange_failures

__all__ = ["GradCompHookState", "exchange_failures", "gradcomp_hook", "no_communication_hook"]


class GradCompHookState(ExchangeSession):
    """The state of the ``gradcomp`` communication hook (one per DDP model and rank): the exchange session
    (:class:`~lightning_gradcomp.exchange.session.ExchangeSession`, whose arguments it takes after
    ``param_names``) and the names of the model's parameters.

    Args:
        compressor: the compressor (or its registered name).
        param_names: ``id(parameter) -> name``; names key the memory, so it survives bucket rebuilds.
    """

    def __init__(
        self,
        compressor: Union[Compressor, str],
        param_names: dict[int, str],
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        group: Optional[dist.ProcessGroup] = None,
        exchange_thread: Optional[bool] = None,
        device: Optional[torch.device] = None,
        *,
        settings: Optional[Mapping[str, str]] = None,
        caller: str = "the DDP hook",
    ) -> None:
        if not isinstance(param_names, dict) or not all(isinstance(n, str) for n in param_names.values()):
            ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)  # their messages come first
            raise ValueError("`param_names` must be a dict of id(parameter) -> parameter name (str), e.g. "
                             "{id(p): n for n, p in model.named_parameters()}")
        super().__init__(compressor, error_feedback, min_compress_numel, seed, group, exchange_thread, device,
                         settings=settings, caller=caller)
        self.param_names = param_names

    def exchange_bucket(self, bucket: dist.GradBucket) -> Future:
        """Exchange one bucket; the future's value is the bucket's buffer holding the average."""
        if isinstance(bucket, tuple):
            raise RuntimeError(
                "gradcomp: DDP called the hook with a (gradient, parameter) pair: compiled autograd's Python "
                "reducer (torch._dynamo.config.optimize_ddp='python_reducer') is not supported; allowed: "
                "optimize_ddp='ddp_optimizer' (the default) or no torch.compile of backward"
            )
        buffer = bucket.buffer()
        return self._for_ddp(self.exchange(self.entries(bucket), last=bucket.is_last(), overlap=True,
                                           value=buffer, keeps_inputs=True))

    def _for_ddp(self, future: Future) -> Future:
        """``future`` in a form whose failure DDP's reducer sees. An error set on a future from Python is
        only a value to the C++ reducer, which then fails to read it as the bucket's tensor ("Unable to
        cast ... to Tensor"); a ``then`` callback that raises fails the returned future in C++, so
        ``backward()`` raises a ``RuntimeError`` carrying the error's type and message. The error itself
        is kept in :attr:`failure` (the strategies re-raise it, see :func:`exchange_failures`)."""
        def value_or_raise(done: Future) -> torch.Tensor:
            try:
                return done.value()
            except BaseException as error:
                if self.failure is None:
                    self.failure = error
                raise
        return future.then(value_or_raise)

    def entries(self, bucket: dist.GradBucket) -> list[Entry]:
        """The bucket's parameters: each gradient's view, which also receives its aggregate."""
        return [Entry(self._name(param), tuple(param.shape), grad.view(-1), grad.view(-1))
                for param, grad in zip(bucket.parameters(), bucket.gradients())]

    def _name(self, param: torch.Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:
            raise RuntimeError("gradcomp hook: a bucket holds a parameter the strategy did not name")
        return name


def gradcomp_hook(state: GradCompHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(GradCompHookState(...), gradcomp_hook)`` (or the
    handle :func:`~lightning_gradcomp.register` makes, which checks the bound optimizer first).

    (This module does not use postponed annotations: DDP checks the hook's annotations as objects.)
    """
    return state.exchange_bucket(bucket)


def no_communication_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """A DDP communication hook that communicates nothing: each rank keeps its own gradient (local-update
    training inside a DDP strategy, :mod:`lightning_gradcomp.local`: the outer loop synchronises instead)."""
    future: Future = Future()
    future.set_result(bucket.buffer())
    return future
