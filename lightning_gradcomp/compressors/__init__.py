"""Gradient compressors behind one interface (:class:`Compressor`), each registered by a short name."""

from lightning_gradcomp.compressors.base import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    Payload,
    get_compressor,
)
from lightning_gradcomp.compressors.dgc import DGC
from lightning_gradcomp.compressors.identity import BF16, FP16, NoCompression
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.sparse import HardThreshold, RandomK, TopK

__all__ = [
    "BF16",
    "COMPRESSORS",
    "CompressContext",
    "Compressor",
    "DGC",
    "FP16",
    "HardThreshold",
    "NoCompression",
    "Payload",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "TopK",
    "get_compressor",
]
