"""The multi-worker entries' options (:class:`MultiWorkerOptions`), checked without TensorFlow
(the command line derives its flags from the options and checks them before any slow work).
The strategies themselves are built in :mod:`.multi_worker`."""

from __future__ import annotations

import dataclasses

from tfpar.cluster import peers as cluster_peers
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import coordination
from tfpar.config_fields import field
from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError

IMPLEMENTATIONS = ("auto", "ring", "nccl")
"""The collective implementations across workers (``nccl``: GPUs only)."""


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
    """How a multi-worker entry finds and talks to its peers: the options of the
    ``multi_worker`` entries, and the train command's flags of the same names.

    Attributes:
        implementation: Collective implementation across workers (nccl: GPUs only).
        cluster: Where the cluster comes from (auto: worker_hosts, else TF_CONFIG, else
            SLURM, else a Kubernetes Indexed Job).
        worker_hosts: host:port of every worker (cluster 'flags').
        task_index: This worker's index in worker_hosts.
        cluster_timeout: Seconds a worker waits for its peers to come up (it says which it is
            waiting for every few seconds) before giving up; once they are up, also the bound
            on TensorFlow's connection of the cluster (a peer that dies then ends it).
        heartbeat_timeout: Seconds without a heartbeat after which a worker counts as lost
            and the job stops with one line naming it (unset: TensorFlow's default, 10 s).
    """

    implementation: str = field("auto", choices=IMPLEMENTATIONS)
    cluster: str = field("auto", choices=cluster_spec.SOURCES)
    worker_hosts: tuple[str, ...] | None = None
    task_index: int | None = None
    cluster_timeout: float = cluster_peers.DEFAULT_TIMEOUT_SECONDS
    heartbeat_timeout: float | None = None

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise OptionValueError(f"Unknown collective implementation {self.implementation!r}. "
                                   f"Allowed: {', '.join(IMPLEMENTATIONS)}.",
                                   argument="implementation")
        if isinstance(self.cluster_timeout, bool) or not (
                isinstance(self.cluster_timeout, (int, float)) and self.cluster_timeout > 0):
            raise ConfigError("{argument} must be a positive number of seconds. Received: "
                              f"{{argument}}={self.cluster_timeout!r}.",
                              argument="cluster_timeout")
        coordination.check_heartbeat_timeout(self.heartbeat_timeout)
