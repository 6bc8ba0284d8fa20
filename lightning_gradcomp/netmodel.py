"""The network model (a public import path, used by YAML configs; it lives in
:mod:`lightning_gradcomp.metrics.netmodel`)."""

from lightning_gradcomp.metrics.netmodel import TOPOLOGIES, Network

__all__ = ["Network", "TOPOLOGIES"]
