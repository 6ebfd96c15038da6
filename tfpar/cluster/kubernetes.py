"""Kubernetes: the cluster of an Indexed ``Job``'s pods behind a headless ``Service``, with no
hand-written ``TF_CONFIG``.

An Indexed Job gives each pod its index in ``JOB_COMPLETION_INDEX`` and the hostname
``<job name>-<index>``; with ``subdomain: <service>`` in the pod template and a headless Service
of that name, every pod is reachable at ``<job name>-<index>.<service>``. The manifest says how
many workers there are (``TFPAR_NUM_WORKERS``, the Job's ``completions``) and names the
Service (``TFPAR_SERVICE``); the port is ``TFPAR_PORT`` (default 2222). The manifests in
``examples/kubernetes/`` set all three. No TensorFlow at import.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tfpar.errors import ClusterError

if TYPE_CHECKING:
    import tensorflow as tf

INDEX_VARIABLE = "JOB_COMPLETION_INDEX"
""": Set by Kubernetes in every pod of an Indexed Job."""
NUM_WORKERS_VARIABLE = "TFPAR_NUM_WORKERS"
""": Set by the manifest: the number of workers (the Job's completions) and the headless Service."""
SERVICE_VARIABLE = "TFPAR_SERVICE"
"""The environment variable naming the headless Service the workers' pods are behind."""
PORT_VARIABLE = "TFPAR_PORT"
"""The environment variable giving the workers' port."""
DEFAULT_PORT = 2222
"""The workers' port when ``TFPAR_PORT`` is not set."""


def detected(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is a pod of an Indexed Job that names its Service for tfpar."""
    return bool(environ.get(INDEX_VARIABLE) and environ.get(SERVICE_VARIABLE))


def _whole(environ: Mapping[str, str], name: str, low: int, high: int | None = None) -> int:
    text = environ.get(name, "")
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        allowed = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ClusterError(f"{name} must be a whole number {allowed}. Received: {text!r}.")
    return int(text)


def cluster_spec(environ: Mapping[str, str], hostname: str) -> tuple[dict, str, int]:
    """The cluster of this pod's Job, as ``TF_CONFIG`` would give it.

    Args:
        environ: The pod's environment (the variables above).
        hostname: The pod's hostname, ``<job name>-<index>``.

    Returns:
        ``({"worker": ["<job>-0.<service>:<port>", ...]}, "worker", index)``.

    Raises:
        ClusterError: If a variable is missing or malformed, or the hostname is not the one
            Kubernetes gives a pod of an Indexed Job.
    """
    if not environ.get(SERVICE_VARIABLE):
        raise ClusterError(f"cluster source 'kubernetes' needs {SERVICE_VARIABLE}, the headless "
                           "Service named as the pods' subdomain (examples/kubernetes/).")
    workers = _whole(environ, NUM_WORKERS_VARIABLE, 1)
    if not environ.get(INDEX_VARIABLE):
        raise ClusterError(f"cluster source 'kubernetes' needs {INDEX_VARIABLE}, which "
                           "Kubernetes sets in the pods of a Job with completionMode: Indexed.")
    index = _whole(environ, INDEX_VARIABLE, 0, workers - 1)
    port = _whole(environ, PORT_VARIABLE, 1, 65535) if environ.get(PORT_VARIABLE) else (
        DEFAULT_PORT)
    host = hostname.split(".")[0]
    suffix = f"-{index}"
    if not host.endswith(suffix) or host == suffix:
        raise ClusterError(f"A pod of an Indexed Job has the hostname <job name>-<index>; this "
                           f"one is {hostname!r} with {INDEX_VARIABLE}={index}. Set "
                           "subdomain (not hostname) in the pod template.")
    job = host[:-len(suffix)]
    service = environ[SERVICE_VARIABLE]
    return ({"worker": [f"{job}-{i}.{service}:{port}" for i in range(workers)]}, "worker",
            index)


def resolver(environ: Mapping[str, str] | None = None, hostname: str | None = None
             ) -> tf.distribute.cluster_resolver.ClusterResolver:
    """A cluster resolver for this pod of an Indexed Job (see the module docstring).

    Raises:
        ClusterError: As :func:`cluster_spec`.
    """
    import tensorflow as tf

    spec, task_type, index = cluster_spec(os.environ if environ is None else environ,
                                          socket.gethostname() if hostname is None else hostname)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task_type, task_id=index, rpc_layer="grpc")
