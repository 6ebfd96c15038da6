"""How the all-reduce of a step grows with the number of workers: the latency-bandwidth model.

An all-reduce of ``S`` bytes over ``N`` workers, each message costing a latency ``a`` (seconds)
plus its bytes over a bandwidth ``b`` (bytes/s), takes (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", 2005):

- **ring** (TensorFlow's ``RING`` collectives across workers, NCCL's ring, tfpar's ``ring``):
  ``2 (N - 1) a + 2 (N - 1) / N * S / b``: the bytes term stays under ``2 S / b`` at any N,
  the latency term grows linearly;
- **tree** (recursive halving and doubling, NCCL's tree): ``2 log2(N) a + 2 (N - 1) / N * S / b``:
  the same bytes, latency growing with log2(N).

:func:`fit` finds ``a`` and ``b`` from measured all-reduce times at several N (the benchmark's
``all-reduce`` column); :func:`predict` gives the time at another N, on the machine measured or
with a network's own latency and bandwidth. What it leaves out: contention between jobs, a
network whose bandwidth per worker drops as N grows (oversubscribed switches), gRPC's per-call
overhead beyond a fixed latency, and overlap of the all-reduce with the backward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tfpar.errors import ConfigError

ALGORITHMS = ("ring", "tree")
"""The all-reduce algorithms the model knows."""


def _terms(algorithm: str, num_workers: int) -> tuple[float, float]:
    """(messages in sequence, fraction of ``2 S`` each worker sends) for one all-reduce."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"Unknown all-reduce algorithm {algorithm!r}. Allowed: "
                          f"{', '.join(ALGORITHMS)}.")
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1. Received: {num_workers}.")
    hops = 2 * (num_workers - 1) if algorithm == "ring" else 2 * math.log2(num_workers)
    return hops, 2 * (num_workers - 1) / num_workers


@dataclasses.dataclass(frozen=True)
class Network:
    """A network as the model sees it.

    Attributes:
        latency: Seconds per message (``a``).
        bandwidth: Bytes per second per worker (``b``); ``math.inf`` when the measurements
            were latency-bound and did not resolve it.
    """

    latency: float
    bandwidth: float


def predict(network: Network, num_workers: int, num_bytes: float,
            algorithm: str = "ring") -> float:
    """Seconds of one all-reduce of ``num_bytes`` over ``num_workers`` on ``network``.

    Raises:
        ConfigError: For an unknown algorithm or fewer than 1 worker.
    """
    hops, share = _terms(algorithm, num_workers)
    return hops * network.latency + share * num_bytes / network.bandwidth


def fit(measured: Sequence[tuple[int, float]], num_bytes: float,
        algorithm: str = "ring") -> Network:
    """The network that explains measured all-reduce times best (least squares).

    Args:
        measured: ``(workers, seconds of one all-reduce)`` at two or more worker counts.
        num_bytes: The bytes reduced (the model's gradients).
        algorithm: What ran: ``ring`` (TensorFlow's collectives across workers) or ``tree``.

    Returns:
        The fitted :class:`Network` (latency >= 0; bandwidth ``inf`` when the bytes term
        fitted to nothing, i.e. the times are latency alone).

    Raises:
        ConfigError: With fewer than two distinct worker counts above 1.
    """
    points = [(n, s) for n, s in measured if n > 1]
    if len({n for n, _ in points}) < 2:
        raise ConfigError("Fitting the all-reduce model needs measurements at two or more "
                          f"worker counts above 1. Received: {list(measured)}.")
    rows = [(*_terms(algorithm, n), s) for n, s in points]
    # Normal equations of s = x * latency + y * (bytes / bandwidth).
    xx = sum(x * x for x, _, _ in rows)
    xy = sum(x * y for x, y, _ in rows)
    yy = sum(y * y for _, y, _ in rows)
    xs = sum(x * s for x, _, s in rows)
    ys = sum(y * s for _, y, s in rows)
    determinant = xx * yy - xy * xy
    latency = (xs * yy - ys * xy) / determinant
    transfer = (xx * ys - xy * xs) / determinant  # Seconds for all the bytes.
    if transfer <= 0:  # Latency-bound: fit the latency alone.
        return Network(max(xs / xx, 0.0), math.inf)
    if latency < 0:  # Bandwidth-bound: fit the bytes alone.
        return Network(0.0, num_bytes / (ys / yy))
    return Network(latency, num_bytes / transfer)
