"""How long a multi-worker job waits for a worker that stopped answering, or that never
registered while the strategy was being built.

``MultiWorkerMirroredStrategy`` configures TensorFlow's coordination service itself when it is
built, unless one is configured already; the service declares a worker that sent no heartbeat
for its *heartbeat timeout* unhealthy and aborts the job's collectives (TensorFlow's default,
when none is given: 10 s). And while the strategy is built, each task registers with the
service's leader: with TensorFlow's defaults a task whose peer died at that moment waits an
hour (the leader's own task waits for ever), inside one C++ call that holds Python's
interpreter, so no signal handler, thread or timer of the program runs. Registering as a
barrier with a timeout (``cluster_register_with_barrier``, ``cluster_register_timeout_in_ms``)
makes every task of that set-up end with ``DeadlineExceededError`` instead.

No public API sets these: ``tensorflow.python.eager.context``'s
``configure_coordination_service`` does, with the same arguments the strategy would give it
(``collective_all_reduce_strategy.py``, TensorFlow 2.16-2.21) plus the timeouts; the barrier
field is set on the configuration it stores. Used only on the TensorFlow versions of
:data:`VERIFIED_TENSORFLOW`, imported behind that gate; elsewhere a heartbeat timeout raises one
line and the set-up keeps TensorFlow's own waits. ``tests/cluster/launcher_test.py`` stops a
worker and measures the job ending well before TensorFlow's default would end it;
``tests/end_to_end/reliability_test.py`` has a peer die during the set-up.
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


def skip_reason() -> str | None:
    """Why the coordination service is left as TensorFlow configures it (``None``: tfpar
    configures it)."""
    import tensorflow as tf

    return versions.tensorflow_skip_reason(tf.__version__)


def configure(cluster_spec, task_type: str, heartbeat_timeout: float | None,
              register_timeout: float) -> None:
    """Configures the coordination service the strategy will use; call it before building the
    strategy.

    Args:
        cluster_spec: The job's ``tf.train.ClusterSpec``.
        task_type: This task's job (only ``chief`` and ``worker`` tasks are coordinated).
        heartbeat_timeout: Seconds without a heartbeat before a worker counts as lost;
            ``None``: TensorFlow's default.
        register_timeout: Seconds within which every task must register while the strategy is
            built, or each fails with ``tf.errors.DeadlineExceededError``.

    Raises:
        ConfigError: For a bad heartbeat timeout, or one on a TensorFlow outside the verified
            range.
    """
    check_heartbeat_timeout(heartbeat_timeout)
    if skip_reason() is not None:
        if heartbeat_timeout is None:
            return  # TensorFlow's own configuration, and its own waits.
        import tensorflow as tf

        raise ConfigError(
            f"{{argument}} is set through TensorFlow internals verified on TensorFlow "
            f"{versions.tensorflow_range_text()}; this is {tf.__version__}. Leave it unset "
            "(TensorFlow's default, 10 s).", argument="heartbeat_timeout")
    context = importlib.import_module("tensorflow.python.eager.context").context()
    if context.coordination_service is not None or task_type not in COORDINATED_JOBS:
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
        heartbeat_timeout_in_ms=0 if heartbeat_timeout is None else int(heartbeat_timeout * 1000),
        cluster_register_timeout_in_ms=max(1, int(register_timeout * 1000)))
    configured = context.coordination_service
    assert configured is not None
    configured.cluster_register_with_barrier = True
