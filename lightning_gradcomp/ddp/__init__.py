"""The DDP communication hook family, on plain ``torch.distributed`` (no Lightning here).

* :mod:`~lightning_gradcomp.ddp.hook` — the flat hook: :class:`GradCompHookState` and :func:`gradcomp_hook`;
* :mod:`~lightning_gradcomp.ddp.hierarchy` — the hierarchical hook (dense inside a node, compressed
  between nodes);
* :mod:`~lightning_gradcomp.ddp.handle` — :func:`register` for a bare ``DistributedDataParallel``;
* :mod:`~lightning_gradcomp.exchange.checkpoint` — the checkpoint entry every way in writes and reads.
"""
