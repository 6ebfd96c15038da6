"""The registry's built-in entries; importing this module registers them.

``default``, ``one_device``, ``mirrored``, ``central_storage``, ``allreduce``, ``multi_worker``
and ``multi_worker_allreduce``. The module imports no TensorFlow: each factory imports what it
builds, so listing the entries and their options (their factories' signatures, made from the
option classes) is instant.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

from tfpar.allreduce.options import StepOptions
from tfpar.config_fields import default_of
from tfpar.strategies.cross_device_ops import ReductionOptions
from tfpar.strategies.multi_worker_options import MultiWorkerOptions
from tfpar.strategies.registry import register

if TYPE_CHECKING:
    import tensorflow as tf

    from tfpar import devices as devices_lib


def _takes(*groups: tuple[type, tuple[str, ...] | None]) -> Callable:
    """Gives a ``factory(devices, **options)`` the options of the option classes' fields (all,
    or those named) as its signature, which the registry lists and checks: each option's
    default is its class's, defined once (the command line's flags derive from the same
    classes)."""
    parameters = [inspect.Parameter("devices", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for cls, names in groups:
        hints = typing.get_type_hints(cls)
        parameters += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                         default=default_of(cls, f.name),
                                         annotation=hints[f.name])
                       for f in dataclasses.fields(cls) if names is None or f.name in names]

    def give(factory: Callable) -> Callable:
        factory.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        return factory

    return give


def _group(cls: type, options: dict[str, Any], **fixed: Any) -> Any:
    """The ``cls`` made of the options it has a field for (its defaults for the rest)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in names}, **fixed)


_WORKERS = (MultiWorkerOptions, None)


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
@_takes((ReductionOptions, None))
def _mirrored(devices: devices_lib.DeviceSet, **options: Any) -> tf.distribute.Strategy:
    """MirroredStrategy: one replica per device, gradients all-reduced, model.fit."""
    from tfpar.strategies.cross_device_ops import make_cross_device_ops
    from tfpar.strategies.mirrored import MirroredStrategy

    reduction = _group(ReductionOptions, options)
    return MirroredStrategy(devices.tf_names, cross_device_ops=make_cross_device_ops(
        reduction.cross_device_ops, devices))


@register("central_storage")
def _central_storage(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """CentralStorageStrategy: variables on one device (the CPU for GPU sets), compute mirrored."""
    from tfpar.strategies.central_storage import CentralStorageStrategy

    parameter_device = "/device:CPU:0" if devices.is_gpu_only else devices.tf_names[0]
    return CentralStorageStrategy(compute_devices=devices.tf_names,
                                  parameter_device=parameter_device)


@register("allreduce")
@_takes((StepOptions, None), (ReductionOptions, None))
def _allreduce(devices: devices_lib.DeviceSet, **options: Any) -> tf.distribute.Strategy:
    """Hand-written exact step in model.fit: split batch, per-replica backward, all-reduce (collective|naive|ring), update."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies.allreduce import AllReduceStrategy
    from tfpar.strategies.cross_device_ops import make_cross_device_ops

    weights = options.pop("split_weights", None)
    return AllReduceStrategy(
        devices.tf_names,
        make_cross_device_ops(_group(ReductionOptions, options).cross_device_ops, devices),
        _group(StepOptions, options, split_weights=None if weights is None else tuple(weights)))


@register("multi_worker", multi_process=True)
@_takes(_WORKERS, (StepOptions, ("bytes_per_pack",)))
def _multi_worker(devices: devices_lib.DeviceSet, **options: Any) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy: every worker process (TF_CONFIG, SLURM or --worker_hosts), one replica per local device."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies import multi_worker as strategy
    from tfpar.strategies.multi_worker import MultiWorkerStrategy

    # TensorFlow packs the gradients from the last layer to the first into buckets of this
    # size, each all-reduced as soon as it is ready (its default, 0, waits for all of them).
    return strategy.make(MultiWorkerStrategy, devices, _group(MultiWorkerOptions, options),
                         bytes_per_pack=options.get("bytes_per_pack",
                                                    default_of(StepOptions, "bytes_per_pack")))


@register("multi_worker_allreduce", multi_process=True)
@_takes(_WORKERS, (StepOptions, ("bytes_per_pack", "gradient_compression",
                                 "accumulation_steps", "virtual_replicas")))
def _multi_worker_allreduce(devices: devices_lib.DeviceSet, **options: Any
                            ) -> tf.distribute.Strategy:
    """multi_worker with the hand-written exact step in model.fit (collective all-reduce across workers)."""  # noqa: E501 (one line: --list_strategies shows it)
    from tfpar.strategies import multi_worker as strategy
    from tfpar.strategies.allreduce import MultiWorkerAllReduceStrategy

    return strategy.make(MultiWorkerAllReduceStrategy, devices,
                         _group(MultiWorkerOptions, options),
                         step_options=_group(StepOptions, options))
