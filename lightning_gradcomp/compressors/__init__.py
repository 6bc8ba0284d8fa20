"""Gradient compressors behind one interface (:class:`Compressor`), each registered by a short name."""

from lightning_gradcomp.compressors.base import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    Payload,
    get_compressor,
)
from lightning_gradcomp.compressors.demo import DeMo
from lightning_gradcomp.compressors.dgc import DGC
from lightning_gradcomp.compressors.identity import BF16, FP16, NoCompression
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.quantised import FP4AllReduce, FP8AllReduce, Int4AllReduce, Int8AllReduce
from lightning_gradcomp.compressors.sign import EFSignSGD, SignSGD
from lightning_gradcomp.compressors.sparse import HardThreshold, RandomK, TopK
from lightning_gradcomp.compressors.sparseloco import SparseLoCo
from lightning_gradcomp.compressors.terngrad import TernGrad

__all__ = [
    "BF16",
    "COMPRESSORS",
    "CompressContext",
    "Compressor",
    "DGC",
    "DeMo",
    "EFSignSGD",
    "FP16",
    "FP4AllReduce",
    "FP8AllReduce",
    "HardThreshold",
    "Int4AllReduce",
    "Int8AllReduce",
    "NoCompression",
    "Payload",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "SignSGD",
    "SparseLoCo",
    "TernGrad",
    "TopK",
    "get_compressor",
]
