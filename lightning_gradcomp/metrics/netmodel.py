r"""Communication-time model: how long a collective takes on a given network.

Notation: ``N`` workers, ``S`` bytes (the input of the collective on one worker, as the collectives'
logs hold it; the bytes *sent*, :func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent`, are
``S`` as well except for an all-to-all, ``(N-1)/N S``), link bandwidth ``B`` (bytes/s), per-message
latency ``α``. The classic alpha-beta cost model (Thakur, Rabenseifner & Gropp, 2005) gives, for the
topologies of Harris 2020 (§4.3.1) and the DDP world:

* ring all-reduce (reduce-scatter then all-gather):
  :math:`T = 2(N-1)\,α + 2\frac{N-1}{N}\frac{S}{B}`
* ring all-gather of ``S`` bytes per worker:
  :math:`T = (N-1)\,α + (N-1)\frac{S}{B}`
* all-to-all of ``S`` bytes per worker (``S/N`` to each worker, pairwise exchanges):
  :math:`T = (N-1)\,α + \frac{N-1}{N}\frac{S}{B}`
* parameter server, push then pull: every worker pushes ``S`` to the server and pulls the result;
  the server's link carries ``N`` streams each way:
  :math:`T = 2α + \frac{N S}{B_s} + \frac{N S_{pull}}{B_s}`,
  with :math:`S_{pull} = S` for a summable (dense) payload and :math:`S_{pull} = N S` for gathered
  payloads (the server forwards every worker's sparse or quantised payload). ``server_bandwidth_gbps``
  defaults to ``N`` times the worker link, so the server is never the bottleneck and the time is
  Harris 2020's estimate, a bi-directional transfer of the payload over one link: :math:`2α + (S + S_{pull})/B`.

Two levels (nodes of ``local_size`` processes): ``intra_bandwidth_gbps`` / ``intra_latency_us`` describe
the links inside a node (NVLink, PCIe, shared memory), ``bandwidth_gbps`` / ``latency_us`` a node's link
to the network. A collective's kind says which processes take part: ``"all_reduce"`` etc. span every
worker (a flat exchange; a ring enters and leaves each node once, so it gets the node's whole link and
the formulas above hold); ``"node:all_reduce"`` runs among the ``local_size`` processes of one node on
the intra-node links; ``"cross:all_gather"`` among the ``workers / local_size`` processes of the same
local rank, one per node — the ``local_size`` such groups of a node run at the same time and share the
node's link, so each is priced at ``bandwidth_gbps / local_size``. The hierarchical exchange
(:class:`~lightning_gradcomp.ddp.hierarchy.HierarchicalHookState`) logs its
collectives with these scopes.

Headers, protocol overheads and congestion are ignored: this is an estimate for comparing compressors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Optional

from lightning_gradcomp.core.checks import check_int

TOPOLOGIES = ("ring", "parameter_server")


@dataclass(frozen=True)
class Network:
    """A network of identical links.

    Args:
        bandwidth_gbps: link bandwidth in Gbit/s (10 Gbit/s Ethernet by default, as in Harris 2020 and QSGD).
        latency_us: per-message latency in microseconds.
        topology: ``"ring"`` (all-reduce / all-gather, as NCCL and gloo do) or ``"parameter_server"``.
        server_bandwidth_gbps: parameter server only: the server's total bandwidth; ``None`` means
            ``N`` times ``bandwidth_gbps`` (no server bottleneck).
        local_size: processes per node, for collectives scoped ``node:`` and ``cross:``.
        intra_bandwidth_gbps / intra_latency_us: the links inside a node (``None``: the same as between
            nodes). Collectives inside a node run as a ring.
    """

    bandwidth_gbps: float = 10.0
    latency_us: float = 50.0
    topology: Literal["ring", "parameter_server"] = "ring"
    server_bandwidth_gbps: Optional[float] = None
    local_size: int = 1
    intra_bandwidth_gbps: Optional[float] = None
    intra_latency_us: Optional[float] = None

    def __post_init__(self) -> None:
        for name, allowed in (("bandwidth_gbps", "a number > 0"), ("server_bandwidth_gbps", "a number > 0"),
                              ("intra_bandwidth_gbps", "a number > 0"), ("latency_us", "a number >= 0"),
                              ("intra_latency_us", "None or a number >= 0")):
            value = getattr(self, name)
            if value is None and name not in ("bandwidth_gbps", "latency_us"):
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or (value < 0 if name.endswith("latency_us") else not value > 0)):
                raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
        check_int(self.local_size, "local_size", 1)
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"`topology` must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    def all_reduce_time(self, nbytes: float, workers: int) -> float:
        """Seconds to all-reduce ``nbytes`` (per worker) among ``workers``."""
        if workers <= 1:
            return 0.0
        if self.topology == "parameter_server":
            return self._push_pull(nbytes, nbytes, workers)
        return 2 * (workers - 1) * self.latency_s + 2 * (workers - 1) / workers * nbytes / self.bytes_per_second

    def all_gather_time(self, nbytes: float, workers: int) -> float:
        """Seconds for every worker to receive every worker's ``nbytes``."""
        if workers <= 1:
            return 0.0
        if self.topology == "parameter_server":
            return self._push_pull(nbytes, workers * nbytes, workers)
        return (workers - 1) * self.latency_s + (workers - 1) * nbytes / self.bytes_per_second

    def all_to_all_time(self, nbytes: float, workers: int) -> float:
        """Seconds for every worker to send a different ``nbytes / workers`` to each worker (its own stays)."""
        if workers <= 1:
            return 0.0
        others = (workers - 1) / workers * nbytes
        if self.topology == "parameter_server":  # relayed by the server: pushed, then pulled
            return self._push_pull(others, others, workers)
        return (workers - 1) * self.latency_s + others / self.bytes_per_second

    def _push_pull(self, push: float, pull: float, workers: int) -> float:
        server = (self.server_bandwidth_gbps * 1e9 / 8) if self.server_bandwidth_gbps else workers * self.bytes_per_second
        link = min(self.bytes_per_second, server / workers)
        return 2 * self.latency_s + push / link + pull / link

    def intra_node(self) -> "Network":
        """The network inside a node: a ring of the intra-node links."""
        return Network(self.intra_bandwidth_gbps or self.bandwidth_gbps,
                       self.latency_us if self.intra_latency_us is None else self.intra_latency_us, "ring")

    def time(self, kind: str, nbytes: float, workers: int) -> float:
        """Seconds for one collective of ``kind`` (``"all_reduce"``, ``"all_gather"`` or ``"all_to_all"``,
        optionally scoped ``"node:..."`` or ``"cross:..."``) among ``workers`` workers in all."""
        scope, _, base = kind.rpartition(":")
        if scope == "node":
            return self.intra_node().time(base, nbytes, min(self.local_size, workers))
        if scope == "cross":  # the node's local_size cross-node groups share its link
            shared = Network(self.bandwidth_gbps / self.local_size, self.latency_us, self.topology,
                             self.server_bandwidth_gbps)
            return shared.time(base, nbytes, max(1, workers // self.local_size))
        if scope:
            raise ValueError(f"`kind` scope must be 'node' or 'cross', got {kind!r}")
        times = {"all_reduce": self.all_reduce_time, "all_gather": self.all_gather_time,
                 "all_to_all": self.all_to_all_time}
        if kind not in times:
            raise ValueError(f"`kind` must be 'all_reduce', 'all_gather' or 'all_to_all', got {kind!r}")
        return times[kind](nbytes, workers)

    def step_time(self, collectives: Iterable[tuple[str, float]], workers: int) -> float:
        """Seconds for a sequence of collectives issued one after another."""
        return sum(self.time(kind, nbytes, workers) for kind, nbytes in collectives)
