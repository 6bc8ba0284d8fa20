"""The bottom layer: what every other layer uses, importing nothing of the package.

* :mod:`~lightning_gradcomp.core.protocol` — the vocabulary of an exchange protocol (rounds, requests,
  outcomes) that compressors speak and the engine runs;
* :mod:`~lightning_gradcomp.core.device` — where the host may read device values, state dtypes, draws
  shared by every worker;
* :mod:`~lightning_gradcomp.core.tensors` — finiteness, norms, item sizes;
* :mod:`~lightning_gradcomp.core.checks` — argument validation.
"""
