"""How long a multi-worker job waits for a worker that stopped answering.

``MultiWorkerMirroredStrategy`` configures TensorFlow's coordination service itself when it is
built, unless one is configured already; the service declares a worker that sent no heartbeat
for its *heartbeat timeout* unhealthy and aborts the job's collectives (TensorFlow's default,
when none is given: 10 s; measured 11 s from ``kill -STOP`` of a worker to the survivors'
error). No public API sets that timeout: ``tensorflow.python.eager.context``'s
``configure_coordination_service`` does, with the same arguments the strategy would give it
(``collective_all_reduce_strategy.py``, TensorFlow 2.16-2.21) plus the timeout. Used only on
the TensorFlow versions of :data:`VERIFIED_TENSORFLOW`, imported behind that gate; elsewhere
asking for a timeout raises one line. ``tests/multiworker/launcher_test.py`` stops a worker
and measures the job ending well before TensorFlow's default would end it.
"""

from __future__ import annotations

import importlib

from tfpar.compat import versions
from tfpar.errors import ConfigError

# The TensorFlow versions whose strategy configures the service as copied below: the range every
# TensorFlow workaround shares.
VERIFIED_TENSORFLOW = versions.VERIFIED_TENSORFLOW
COORDINATED_JOBS = ("chief", "worker")


def check_heartbeat_timeout(seconds: float | None) -> None:
    """Raises unless ``seconds`` is ``None`` (TensorFlow's default) or a number > 0.

    Raises:
        ConfigError: Naming the argument.
    """
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError(f"{{argument}} must be a positive number of seconds. Received: "
                          f"{{argument}}={seconds!r}.", argument="heartbeat_timeout")


def configure_heartbeat_timeout(cluster_spec, seconds: float | None) -> None:
    """Configures the coordination service the strategy will use, with ``seconds`` as its
    heartbeat timeout; call it before building the strategy. ``None``: TensorFlow's default.

    Args:
        cluster_spec: The job's ``tf.train.ClusterSpec``.
        seconds: The heartbeat timeout.

    Raises:
        ConfigError: For a bad value, or a timeout on a TensorFlow outside the verified range.
    """
    check_heartbeat_timeout(seconds)
    if seconds is None:
        return
    import tensorflow as tf

    if not versions.tensorflow_verified(tf.__version__):
        raise ConfigError(
            f"{{argument}} is set through TensorFlow internals verified on TensorFlow "
            f"{versions.tensorflow_range_text()}; this is {tf.__version__}. Leave it unset "
            "(TensorFlow's default, 10 s).", argument="heartbeat_timeout")
    context = importlib.import_module("tensorflow.python.eager.context").context()
    if context.coordination_service is not None:
        return  # Configured already (a second strategy in this process): TensorFlow's rule.
    config_pb2 = importlib.import_module("tensorflow.compiler.xla.tsl.protobuf."
                                         "coordination_config_pb2")
    jobs = [job for job in COORDINATED_JOBS if job in cluster_spec.jobs]
    leader = "chief" if "chief" in jobs else "worker"
    context.configure_coordination_service(
        service_type="standalone", service_leader=f"/job:{leader}/replica:0/task:0",
        coordinated_jobs=[config_pb2.CoordinatedJob(name=job,
                                                    num_tasks=cluster_spec.num_tasks(job))
                          for job in jobs],
        heartbeat_timeout_in_ms=int(seconds * 1000))
