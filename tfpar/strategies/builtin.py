"""The registry's built-in entries; importing this module registers them.

``default``, ``one_device``, ``mirrored``, ``central_storage``, ``allreduce``, ``multi_worker``
and ``multi_worker_allreduce``. The module imports no TensorFlow: each factory imports what it
builds, so listing the entries and their options (their factories' signatures) is instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfpar.allreduce.options import StepOptions
from tfpar.strategies.cross_device_ops import ReductionOptions
from tfpar.strategies.multi_worker_options import MultiWorkerOptions
from tfpar.strategies.registry import register

if TYPE_CHECKING:
    import tensorflow as tf

    from tfpar import devices as devices_lib

# The options' defaults are their option classes' (which the command line's flags share).
_STEP = StepOptions()
_REDUCTION = ReductionOptions()
_WORKERS = MultiWorkerOptions()


@register("default", max_devices=1)
def _default(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """No distribution: TensorFlow's default strategy and placement (one device)."""
    import tensorflow as tf

    return tf.distribute.get_strategy()


@register("one_device", max_devices=1)
def _one_device(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """OneDeviceStrategy: everything placed on the one device of the set."""
    from tfpar.strategies.one_device import OneDeviceStrategy

    return OneDeviceStrategy(devices.tf_names[0])


@register("mirrored")
def _mirrored(devices: devices_lib.DeviceSet,
              cross_device_ops: str = _REDUCTION.cross_device_ops) -> tf.distribute.Strategy:
    """MirroredStrategy: one replica per device, gradients all-reduced, model.fit."""
    from tfpar.strategies.cross_device_ops import make_cross_device_ops
    from tfpar.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(
        devices.tf_names, cross_device_ops=make_cross_device_ops(cross_device_ops, devices))


# Keras 3's loss tracker updates its variables wrongly under this strategy: the running loss
# it logs is wrong after the first step (the weights train exactly; tested).
@register("central_storage")
def _central_storage(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """CentralStorageStrategy: variables on one device (the CPU for GPU sets), compute mirrored."""
    from tfpar.strategies.central_storage import CentralStorageStrategy

    parameter_device = "/device:CPU:0" if devices.is_gpu_only else devices.tf_names[0]
    return CentralStorageStrategy(compute_devices=devices.tf_names,
                                  parameter_device=parameter_device)


def _step_options(algorithm, bytes_per_pack, split_weights, gradient_compression,
                  accumulation_steps) -> StepOptions:
    return StepOptions(algorithm, bytes_per_pack,
                       None if split_weights is None else tuple(split_weights),
                       gradient_compression, accumulation_steps)


@register("allreduce")
def _allreduce(devices: devices_lib.DeviceSet, algorithm: str = _STEP.algorithm,
               bytes_per_pack: int = _STEP.bytes_per_pack,
               split_weights: tuple[float, ...] | None = _STEP.split_weights,
               gradient_compression: str = _STEP.gradient_compression,
               accumulation_steps: int = _STEP.accumulation_steps,
               cross_device_ops: str = _REDUCTION.cross_device_ops) -> tf.distribute.Strategy:
    """Hand-written exact step in model.fit: split batch, per-replica backward, all-reduce (collective|naive|ring), update."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies.allreduce import AllReduceStrategy
    from tfpar.strategies.cross_device_ops import make_cross_device_ops

    return AllReduceStrategy(
        devices.tf_names, make_cross_device_ops(cross_device_ops, devices),
        _step_options(algorithm, bytes_per_pack, split_weights, gradient_compression,
                      accumulation_steps))


@register("multi_worker", multi_process=True)
def _multi_worker(devices: devices_lib.DeviceSet,
                  implementation: str = _WORKERS.implementation,
                  cluster: str = _WORKERS.cluster,
                  worker_hosts: tuple[str, ...] | None = _WORKERS.worker_hosts,
                  task_index: int | None = _WORKERS.task_index,
                  cluster_timeout: float = _WORKERS.cluster_timeout,
                  bytes_per_pack: int = _STEP.bytes_per_pack,
                  heartbeat_timeout: float | None = _WORKERS.heartbeat_timeout
                  ) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy: every worker process (TF_CONFIG, SLURM or --worker_hosts), one replica per local device."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies import multi_worker as strategy
    from tfpar.strategies.multi_worker import MultiWorkerStrategy

    # TensorFlow packs the gradients from the last layer to the first into buckets of this
    # size, each all-reduced as soon as it is ready (its default, 0, waits for all of them).
    return strategy.make(MultiWorkerStrategy, devices, MultiWorkerOptions(
        implementation, cluster, worker_hosts, task_index, cluster_timeout, heartbeat_timeout),
        bytes_per_pack=bytes_per_pack)


@register("multi_worker_allreduce", multi_process=True)
def _multi_worker_allreduce(devices: devices_lib.DeviceSet,
                            implementation: str = _WORKERS.implementation,
                            cluster: str = _WORKERS.cluster,
                            worker_hosts: tuple[str, ...] | None = _WORKERS.worker_hosts,
                            task_index: int | None = _WORKERS.task_index,
                            cluster_timeout: float = _WORKERS.cluster_timeout,
                            bytes_per_pack: int = _STEP.bytes_per_pack,
                            gradient_compression: str = _STEP.gradient_compression,
                            accumulation_steps: int = _STEP.accumulation_steps,
                            heartbeat_timeout: float | None = _WORKERS.heartbeat_timeout
                            ) -> tf.distribute.Strategy:
    """multi_worker with the hand-written exact step in model.fit (collective all-reduce across workers)."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies import multi_worker as strategy
    from tfpar.strategies.allreduce import MultiWorkerAllReduceStrategy

    return strategy.make(MultiWorkerAllReduceStrategy, devices, MultiWorkerOptions(
        implementation, cluster, worker_hosts, task_index, cluster_timeout, heartbeat_timeout),
        step_options=_step_options("collective", bytes_per_pack, None, gradient_compression,
                                   accumulation_steps))
