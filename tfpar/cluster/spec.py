"""A multi-worker cluster's specification: where the workers are, checked before any
connection is tried, and what this process is in it.

The cluster comes from ``TF_CONFIG`` (set by Ray Train, Vertex AI, or
:mod:`tfpar.cluster.launcher`), from SLURM (:mod:`.slurm`), from a Kubernetes Indexed Job
(:mod:`.kubernetes`), or from explicit ``worker_hosts`` and ``task_index``. A malformed or
inconsistent spec raises :class:`~tfpar.errors.ClusterError` saying what is wrong. No
TensorFlow at import (the command line reads this module's constants).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from tfpar.cluster import kubernetes
from tfpar.cluster import slurm
from tfpar.errors import ClusterError

if TYPE_CHECKING:  # Imported where used: the command line reads this module's constants.
    import tensorflow as tf

SOURCES = ("auto", "tf_config", "slurm", "kubernetes", "flags")
"""Where a multi-worker cluster comes from (``auto``: the first found of TF_CONFIG, Slurm,
Kubernetes).
"""
TASK_TYPES = ("chief", "worker")
"""The task types of a multi-worker cluster."""


def _check_address(address: Any, where: str) -> None:
    host, sep, port = str(address).rpartition(":")
    if not (isinstance(address, str) and sep and host and port.isdigit()
            and 1 <= int(port) <= 65535):
        raise ClusterError(f"{where}: addresses are 'host:port' with a port from 1 to 65535. "
                           f"Received: {address!r}.")


def check_spec(cluster: Any, task_type: Any, task_index: Any) -> None:
    """Raises unless ``cluster`` and the task describe a usable cluster.

    Args:
        cluster: ``{"worker": ["host:port", ...], "chief": [...]}`` (chief optional).
        task_type: This process's task type (``"worker"`` or ``"chief"``).
        task_index: This process's index within its task type.

    Raises:
        ClusterError: On any malformed or inconsistent part.
    """
    if not isinstance(cluster, dict) or not cluster.get("worker") and not cluster.get("chief"):
        raise ClusterError("The cluster needs a 'worker' list of 'host:port' addresses "
                           f"(and optionally one 'chief'). Received: cluster={cluster!r}.")
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(f"Unsupported task type(s) {', '.join(unknown)} in the cluster; "
                           f"allowed: {', '.join(TASK_TYPES)}.")
    seen = set()
    for kind, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses:
            raise ClusterError(f"cluster[{kind!r}] must be a non-empty list of 'host:port'. "
                               f"Received: {addresses!r}.")
        for address in addresses:
            _check_address(address, f"cluster[{kind!r}]")
            if address in seen:
                raise ClusterError(f"Address {address} appears twice in the cluster.")
            seen.add(address)
    if len(cluster.get("chief", [])) > 1:
        raise ClusterError(f"A cluster has at most one chief. Received: {cluster['chief']}.")
    if task_type not in cluster:
        raise ClusterError(f"This task's type {task_type!r} is not in the cluster "
                           f"({', '.join(cluster)}).")
    if (isinstance(task_index, bool) or not isinstance(task_index, int)
            or not 0 <= task_index < len(cluster[task_type])):
        raise ClusterError(f"The task index must be from 0 to {len(cluster[task_type]) - 1} for "
                           f"{len(cluster[task_type])} {task_type}(s). Received: {task_index!r}.")


def parse_tf_config(text: str) -> tuple[dict, str, int]:
    """Parses and checks a ``TF_CONFIG`` value.

    Returns:
        ``(cluster, task_type, task_index)``.

    Raises:
        ClusterError: If it is not JSON or describes no usable cluster.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e.msg} at character {e.pos}). It "
                           'looks like {"cluster": {"worker": ["host:port", ...]}, "task": '
                           '{"type": "worker", "index": 0}}.') from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), dict):
        raise ClusterError('TF_CONFIG needs "cluster" and "task" ({"type": ..., "index": ...}). '
                           f"Received: {text!r}.")
    task = config["task"]
    check_spec(config.get("cluster"), task.get("type"), task.get("index"))
    return config["cluster"], task["type"], task["index"]


def resolver(source: str = "auto", worker_hosts: Sequence[str] | None = None,
             task_index: int | None = None
             ) -> tf.distribute.cluster_resolver.ClusterResolver | None:
    """Returns the cluster resolver for ``source``, after checking the spec.

    Args:
        source: ``"tf_config"``, ``"slurm"``, ``"kubernetes"``, ``"flags"``
            (``worker_hosts`` and ``task_index``), or ``"auto"``: flags when ``worker_hosts``
            is given, else ``TF_CONFIG`` when set, else SLURM when ``SLURM_JOB_ID`` is set,
            else Kubernetes when ``JOB_COMPLETION_INDEX`` and ``TFPAR_SERVICE`` are set, else
            ``None`` (a single worker).
        worker_hosts: ``host:port`` of every worker (``"flags"``).
        task_index: This worker's index in ``worker_hosts`` (``"flags"``).

    Returns:
        A ``ClusterResolver``, or ``None`` for a single local worker.

    Raises:
        ClusterError: If the source is unknown or the spec is malformed.
    """
    import tensorflow as tf

    if source not in SOURCES:
        raise ClusterError(f"Unknown cluster source {source!r}. Allowed: {', '.join(SOURCES)}.")
    if source == "auto":
        detected = ("flags" if worker_hosts else "tf_config" if os.environ.get("TF_CONFIG")
                    else "slurm" if os.environ.get("SLURM_JOB_ID")
                    else "kubernetes" if kubernetes.detected(os.environ) else None)
        if detected is None:
            return None
        source = detected
    if source == "flags":
        hosts = list(worker_hosts or [])
        check_spec({"worker": hosts}, "worker", task_index)
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": hosts}), task_type="worker", task_id=task_index,
            rpc_layer="grpc")
    if source == "tf_config":
        if not os.environ.get("TF_CONFIG"):
            raise ClusterError("cluster source 'tf_config' needs the TF_CONFIG environment "
                               "variable, which is not set.")
        parse_tf_config(os.environ["TF_CONFIG"])
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if source == "kubernetes":
        return kubernetes.resolver()
    return slurm.resolver()


def tasks_on_host(cluster: dict[str, Any], task_type: str, task_index: int) -> int:
    """How many tasks of ``cluster`` (chief and workers) have this task's host in their
    address, this task included.

    Args:
        cluster: ``{"worker": ["host:port", ...], "chief": [...]}`` (a job may also be
            ``{index: "host:port"}``, as ``ClusterSpec.as_dict`` gives a sparse one).
        task_type: This task's type.
        task_index: This task's index within its type.
    """
    def addresses(job: str) -> list[str]:  # A sparse job is {index: address}.
        tasks = cluster.get(job, ())
        return list(tasks.values()) if isinstance(tasks, dict) else list(tasks)

    host = split_address(cluster[task_type][task_index])[0]
    return sum(split_address(address)[0] == host
               for job in TASK_TYPES for address in addresses(job))


def tasks_on_this_host(cluster_resolver: Any) -> int:
    """:func:`tasks_on_host` for this task of ``cluster_resolver`` (1 without a cluster)."""
    spec = cluster_resolver.cluster_spec().as_dict() if cluster_resolver is not None else {}
    if not spec:
        return 1
    return tasks_on_host(spec, cluster_resolver.task_type, cluster_resolver.task_id)


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    """Returns whether ``strategy`` trains across several worker processes."""
    cluster_resolver = getattr(strategy, "cluster_resolver", None)
    if cluster_resolver is None:
        return False
    spec = cluster_resolver.cluster_spec()
    return sum(spec.num_tasks(job) for job in spec.jobs) > 1


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Returns whether this process is the chief (the one that writes results and files).

    The chief is the ``chief`` task, or worker 0 when the cluster has no chief; a
    single-process strategy is always its own chief.
    """
    cluster_resolver = getattr(strategy, "cluster_resolver", None)
    if cluster_resolver is None or not cluster_resolver.task_type:
        return True
    spec = cluster_resolver.cluster_spec().as_dict()
    if cluster_resolver.task_type == "chief":
        return True
    return "chief" not in spec and cluster_resolver.task_id == 0


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (brackets of an IPv6 host removed)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
