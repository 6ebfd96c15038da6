"""The ``multi_worker`` strategy class, and :func:`make`, which builds a multi-worker strategy
(options checked, threads set as tuned for the workers sharing this host, peers awaited, then
connected) for the ``multi_worker`` and ``multi_worker_allreduce`` entries."""

from __future__ import annotations

import contextlib
from typing import Any

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.allreduce.options import check_bytes_per_pack
from tfpar.cluster import peers as cluster_peers
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import coordination
from tfpar.compat import multi_worker_cpus
from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError
from tfpar.host import worker_threads
from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.multi_worker_options import MultiWorkerOptions
from tfpar.strategies.refusals import KERAS_OPTIMIZER_UPDATE
from tfpar.strategies.refusals import MULTI_STEP_EXECUTION


class MultiWorkerStrategy(TfparStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` (Keras's own step) that refuses what it cannot run
    across workers and what Keras's optimizer cannot apply under it
    (:mod:`tfpar.strategies.refusals`)."""

    refusals = (MULTI_STEP_EXECUTION, *KERAS_OPTIMIZER_UPDATE)


def make(strategy_class: type, devices: devices_lib.DeviceSet, options: MultiWorkerOptions,
         bytes_per_pack: int = 0, **extra: Any) -> tf.distribute.Strategy:
    """Checks the options against the devices, waits for the cluster, builds the strategy.

    Args:
        strategy_class: ``tf.distribute.MultiWorkerMirroredStrategy`` or a subclass.
        devices: This worker's devices: its GPUs, or logical CPU devices (one replica each;
            several only where :mod:`tfpar.compat.multi_worker_cpus` applies).
        options: How to find and talk to the peers.
        bytes_per_pack: Gradient bucket size of TensorFlow's all-reduce.
        **extra: More arguments of ``strategy_class``.

    Returns:
        The connected strategy.

    Raises:
        OptionValueError: For an implementation the devices cannot run.
        ConfigError: For a bad bucket size.
        ClusterError: If the cluster spec is malformed or the peers do not come up.
    """
    if options.implementation == "nccl" and not devices.is_gpu_only:
        raise OptionValueError(f"implementation='nccl' needs GPUs; {devices} has other devices. "
                               "Use 'ring' or 'auto'.")
    if not devices.is_gpu_only and any("/device:CPU:" not in n for n in devices.tf_names):
        raise OptionValueError("A multi_worker process runs on its GPUs or on CPU devices, not "
                               f"both. Received: {devices}.")
    several_cpus = not devices.is_gpu_only and len(devices) > 1
    reason = multi_worker_cpus.skip_reason() if several_cpus else None
    if reason:
        raise OptionValueError(f"A multi_worker process runs one CPU replica here ({reason}); use "
                               f"one device per worker and more workers. Received: {devices}.")
    check_bytes_per_pack(bytes_per_pack, "one all-reduce of every gradient")
    resolver = cluster_spec.resolver(options.cluster, options.worker_hosts, options.task_index)
    worker_threads.set_threads(cluster_spec.tasks_on_this_host(resolver))
    if devices.is_gpu_only:  # The strategy uses every visible GPU: show it only the set.
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices([gpus[int(n.split(":")[1])] for n in devices], "GPU")
    kind = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
            }[options.implementation]
    communication = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bytes_per_pack, implementation=kind)
    if resolver is not None and resolver.cluster_spec().jobs:
        coordination.configure(resolver.cluster_spec(), resolver.task_type,
                               options.heartbeat_timeout, options.cluster_timeout)

    def build() -> tf.distribute.Strategy:
        # Several logical CPU devices: one replica each, as a worker's GPUs are.
        with (multi_worker_cpus.local_cpu_devices(devices.tf_names) if several_cpus
              else contextlib.nullcontext()):
            return strategy_class(cluster_resolver=resolver, communication_options=communication,
                                  **extra)

    strategy = cluster_peers.connect(build, resolver, options.cluster_timeout)
    if resolver is not None and resolver.cluster_spec().jobs:
        _check_same_replicas(resolver, len(devices), options.cluster_timeout)
    return strategy


def _check_same_replicas(resolver: tf.distribute.cluster_resolver.ClusterResolver,
                         local: int, timeout: float) -> None:
    """Checks that every worker of the job trains on as many devices as this one.

    TensorFlow's strategy sizes its collectives as this worker's devices times the workers, so
    workers of unequal device counts would wait for each other in the first all-reduce until
    stopped.

    Args:
        resolver: The job's cluster.
        local: This worker's devices (replicas).
        timeout: Seconds to wait for the peers' counts (see
            :func:`tfpar.cluster.peers.counts_of_every_worker`).

    Raises:
        ConfigError: If some worker has another number of devices (one line naming each).
    """
    known = cluster_peers.counts_of_every_worker(resolver, "local_replicas", local,
                                                 "how many devices it trains on", timeout)
    if len(set(known.values())) > 1:
        each = ", ".join(f"{job} {index}: {count}" for (job, index), count in known.items())
        raise ConfigError(f"Every worker of a job must train on as many devices as the others "
                          f"(TensorFlow's all-reduce spans each worker's devices times the "
                          f"workers); this job's have {each}. Give each worker the same number "
                          f"of GPUs or logical CPU devices.")
