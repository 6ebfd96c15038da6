"""The ``multi_worker`` strategy class, and :func:`make`, which builds a multi-worker strategy
(options checked, threads set as tuned for the workers sharing this host, peers awaited, then
connected) for the ``multi_worker`` and ``multi_worker_allreduce`` entries."""

from __future__ import annotations

import os

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar import thread_layouts
from tfpar.allreduce.options import check_bytes_per_pack
from tfpar.cluster import peers as cluster_peers
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import coordination
from tfpar.errors import OptionValueError
from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.multi_worker_options import MultiWorkerOptions
from tfpar.strategies.refusals import KERAS_OPTIMIZER_UPDATE
from tfpar.strategies.refusals import MULTI_STEP_EXECUTION

# TensorFlow's environment variables for its thread counts (read when it initialises).
_THREAD_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


class MultiWorkerStrategy(TfparStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` (Keras's own step) that refuses what it cannot run
    across workers and what Keras's optimizer cannot apply under it
    (:mod:`tfpar.strategies.refusals`)."""

    refusals = (MULTI_STEP_EXECUTION, *KERAS_OPTIMIZER_UPDATE)


def _leave_a_thread_for_collectives() -> None:
    """Gives a worker with cores to spare a second inter-op thread, unless TensorFlow started.

    With one inter-op thread, TensorFlow's executor follows the backward pass's chain of ops
    inline on it, and a gradient bucket's all-reduce, ready early, waits in the pool until the
    whole backward pass is done; with two it starts at once and the bytes travel while the
    backward pass goes on (a profile of ResNet-18 on 2 workers: 11 of 14 buckets during the
    backward pass, against none). Only where the worker has several compute threads: with one
    core per worker the extra thread contended with the compute and cost more than the overlap
    gave (0.82 against 0.88 of the no-communication ceiling).
    """
    try:
        if (tf.config.threading.get_inter_op_parallelism_threads() == 1
                and tf.config.threading.get_intra_op_parallelism_threads() >= 2):
            tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:
        pass  # TensorFlow has initialised: its threads are fixed.


def _user_set_threads() -> bool:
    """Whether the user set TensorFlow's threads (``tf.config.threading`` or its variables)."""
    return bool(any(os.environ.get(name) for name in _THREAD_ENV)
                or tf.config.threading.get_intra_op_parallelism_threads()
                or tf.config.threading.get_inter_op_parallelism_threads())


def _threads_from_the_budget() -> bool:
    """Sets this worker's threads to ``OMP_NUM_THREADS``, the CPUs a scheduler gave it (Ray
    sets it to a worker's CPUs; TensorFlow itself ignores it), unless the user set threads;
    returns whether it did. A worker of several threads gets a second inter-op thread for its
    collectives (:func:`_leave_a_thread_for_collectives`)."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    if not budget.isdigit() or int(budget) < 1 or _user_set_threads():
        return False
    try:
        tf.config.threading.set_intra_op_parallelism_threads(int(budget))
        tf.config.threading.set_inter_op_parallelism_threads(2 if int(budget) >= 2 else 1)
    except RuntimeError:
        return False  # TensorFlow has initialised: its threads are fixed.
    return True


def _threads_tuned_for_the_host(resolver) -> bool:
    """Sets this worker's threads as ``--tune`` stored them for this many workers on one host
    of this machine kind (:func:`tfpar.thread_layouts.chosen_for_workers`); returns whether it
    did. Threads the user set (``tf.config.threading``, ``TF_NUM_INTRAOP_THREADS``,
    ``TF_NUM_INTEROP_THREADS``) win, and nothing changes once TensorFlow has initialised."""
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec or _user_set_threads():
        return False
    workers = cluster_spec.tasks_on_host(spec, resolver.task_type, resolver.task_id)
    layout = thread_layouts.chosen_for_workers(workers)[0] if workers > 1 else None
    if layout is None:
        return False
    try:
        tf.config.threading.set_intra_op_parallelism_threads(layout.threads_per_device)
        tf.config.threading.set_inter_op_parallelism_threads(layout.inter_op(1))
    except RuntimeError:
        return False  # TensorFlow has initialised: its threads are fixed.
    return True


def make(strategy_class: type, devices: devices_lib.DeviceSet, options: MultiWorkerOptions,
         bytes_per_pack: int = 0, **extra) -> tf.distribute.Strategy:
    """Checks the options against the devices, waits for the cluster, builds the strategy.

    Args:
        strategy_class: ``tf.distribute.MultiWorkerMirroredStrategy`` or a subclass.
        devices: This worker's devices (one CPU, or its GPUs).
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
    if not devices.is_gpu_only and len(devices) != 1:
        raise OptionValueError("On CPUs each multi_worker process runs one replica; use one "
                               f"device per worker and more workers. Received: {devices}.")
    check_bytes_per_pack(bytes_per_pack, "one all-reduce of every gradient")
    resolver = cluster_spec.resolver(options.cluster, options.worker_hosts, options.task_index)
    if not (_threads_from_the_budget() or _threads_tuned_for_the_host(resolver)):
        _leave_a_thread_for_collectives()
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
    return cluster_peers.connect(
        lambda: strategy_class(cluster_resolver=resolver, communication_options=communication,
                               **extra),
        resolver, options.cluster_timeout)
