"""The multi-worker entries' options (:class:`MultiWorkerOptions`) and what they refuse,
checked without TensorFlow (the command line derives its flags from the options and calls
:func:`check_steps_per_execution` before any slow work). The strategies themselves are built
in :mod:`.multi_worker`."""

from __future__ import annotations

import dataclasses

from tfpar.compat import coordination
from tfpar.config_fields import field
from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError
from tfpar.multiworker import cluster as cluster_lib

IMPLEMENTATIONS = ("auto", "ring", "nccl")


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
    """How a multi-worker entry finds and talks to its peers: the options of the
    ``multi_worker`` entries, and the train command's flags of the same names.

    Attributes:
        implementation: Collective implementation across workers (nccl: GPUs only).
        cluster: Where the cluster comes from (auto: worker_hosts, else TF_CONFIG, else
            SLURM).
        worker_hosts: host:port of every worker (cluster 'flags').
        task_index: This worker's index in worker_hosts.
        cluster_timeout: Seconds a worker waits for its peers to come up (it says which it is
            waiting for every few seconds) before giving up.
        heartbeat_timeout: Seconds without a heartbeat after which a worker counts as lost
            and the job stops with one line naming it (unset: TensorFlow's default, 10 s).
    """

    implementation: str = field("auto", choices=IMPLEMENTATIONS)
    cluster: str = field("auto", choices=cluster_lib.SOURCES)
    worker_hosts: tuple[str, ...] | None = None
    task_index: int | None = None
    cluster_timeout: float = cluster_lib.DEFAULT_TIMEOUT_SECONDS
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


def check_steps_per_execution(steps_per_execution: int) -> None:
    """Raises for several training steps per compiled call across workers.

    Keras runs them in a ``tf.while_loop`` whose steps sit in a ``tf.cond``; with a
    cross-worker collective inside, TensorFlow 2.21 fails at the first call ("You must feed a
    value for placeholder tensor 'while/cond/Placeholder'", for Keras's own step and tfpar's
    alike; keras-team/keras#19246). Refused before any work instead.

    Raises:
        ConfigError: If ``steps_per_execution`` is above 1.
    """
    if steps_per_execution > 1:
        raise ConfigError("{argument} > 1 does not run across workers (TensorFlow 2.21 / Keras "
                          "3.15 fail inside Keras's multi-step loop, keras-team/keras#19246). "
                          f"Use {{argument}}=1 with multi-worker strategies. Received: "
                          f"{{argument}}={steps_per_execution}.", argument="steps_per_execution")
