"""The exchange engine: one bucket's compressed exchange, written once, driven by torch.distributed
(:class:`~lightning_gradcomp.exchange.drivers.TorchDriver`, inside the DDP hook) or in process for N
simulated workers (:class:`~lightning_gradcomp.exchange.drivers.InProcessDriver`).

* :mod:`~lightning_gradcomp.exchange.engine` — a bucket: routing, merging every tensor's requests of a
  round into one collective per kind, finiteness, decoding;
* :mod:`~lightning_gradcomp.exchange.pipeline` — one worker's side: error feedback, compressor state,
  telemetry (its memory: :mod:`~lightning_gradcomp.exchange.memory`);
* :mod:`~lightning_gradcomp.exchange.wire` — byte layout of packed payloads;
* :mod:`~lightning_gradcomp.exchange.drivers` — the collectives, and the count of their bytes;
* :mod:`~lightning_gradcomp.exchange.thread` — the exchange thread and the exchange's CUDA stream;
* :mod:`~lightning_gradcomp.exchange.simulated` — N workers' exchange in one process;
* :mod:`~lightning_gradcomp.exchange.state` — what the DDP hook's state and the simulation both offer
  (the contract callbacks and strategies use), and the per-worker state dict;
* :mod:`~lightning_gradcomp.exchange.options` — the compression options, validated.

The vocabulary of a protocol (rounds, requests) is :mod:`lightning_gradcomp.core.protocol`.
"""
