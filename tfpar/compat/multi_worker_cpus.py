"""Several logical CPU devices per worker under ``MultiWorkerMirroredStrategy``.

TensorFlow's multi-worker strategy runs one replica per local GPU, and on a worker without GPUs
exactly one, on its CPU: ``CollectiveAllReduceExtended._initialize_local_devices`` (read in
2.21) counts GPUs and TPUs only and otherwise takes one CPU device, whatever logical CPU
devices the process has. No public API gives it other local devices in a cluster (the
strategy's ``_from_local_devices`` is single-worker, and ``tf.config`` cannot present logical
CPUs as GPUs). So a worker of several devices, what every multi-GPU machine runs, could not be
run or tested on CPUs: not a 2 x 2 job's all-reduce, not the input dealt to two local replicas
of each worker, not ``virtual_replicas`` with two shards per worker.

:func:`local_cpu_devices` has the strategy built inside it take the given logical CPU devices
of the worker as its local devices, one replica each, exactly as it takes a worker's GPUs (the
same collectives, a group of ``devices x workers``). Used by
:func:`tfpar.strategies.multi_worker.make` for a set of several CPU devices, on the TensorFlow
versions of :data:`VERIFIED_TENSORFLOW` only and imported behind that gate
(:func:`skip_reason`); elsewhere such a set is refused in one line.
``tests/compat/multi_worker_cpus_test.py`` shows one CPU replica per worker without it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

from tfpar.compat import class_patch
from tfpar.compat import versions

VERIFIED_TENSORFLOW = versions.VERIFIED_TENSORFLOW
_MODULE = "tensorflow.python.distribute.collective_all_reduce_strategy"
_METHOD = "_initialize_local_devices"


def _extended_class() -> Any:
    return importlib.import_module(_MODULE).CollectiveAllReduceExtended


def skip_reason() -> str | None:
    """Why a worker cannot run several CPU devices on this TensorFlow (``None``: it can)."""
    return versions.tensorflow_member_skip_reason(_MODULE, "CollectiveAllReduceExtended", _METHOD)


@contextlib.contextmanager
def local_cpu_devices(names: Sequence[str]) -> Iterator[None]:
    """A multi-worker strategy built inside runs one replica on each of these logical CPU
    devices of this worker.

    Only where :func:`skip_reason` is ``None``; the caller checks, and makes the logical
    devices before TensorFlow starts. Strategies built before or after are unaffected.

    Args:
        names: The devices, as TensorFlow names them in a process (``/device:CPU:1``).
    """
    def cpus(self, cluster_resolver, worker_device):
        return tuple(f"{worker_device}{name}" for name in names), "CPU"

    with class_patch.attribute_set(_extended_class(), _METHOD, cpus):
        yield
