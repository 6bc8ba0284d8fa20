"""The exchange engine: one bucket's compressed exchange, written once, driven by torch.distributed
(:class:`~lightning_gradcomp.exchange.drivers.TorchDriver`, inside the DDP hook) or in process for N
simulated workers (:class:`~lightning_gradcomp.exchange.drivers.InProcessDriver`).

* :mod:`~lightning_gradcomp.exchange.protocol` — rounds and requests a compressor's protocol yields;
* :mod:`~lightning_gradcomp.exchange.engine` — a bucket: routing, error feedback, merging every
  tensor's requests of a round into one collective per kind, decoding;
* :mod:`~lightning_gradcomp.exchange.drivers` — the collectives, and the count of their bytes;
* :mod:`~lightning_gradcomp.exchange.wire` — byte layout of packed payloads.
"""

from lightning_gradcomp.exchange.protocol import Gather, Mean, Outcome, Protocol, Received, Round

__all__ = ["Gather", "Mean", "Outcome", "Protocol", "Received", "Round"]
