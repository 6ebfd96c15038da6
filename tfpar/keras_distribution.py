"""Keras's own distribution API, ``keras.distribution``, on TensorFlow: trained through tfpar.

On the TensorFlow backend Keras's ``DataParallel`` is accepted and does nothing: ``fit`` trains
under TensorFlow's default strategy, every variable on one device (keras-team/keras#18983).
After one call, :func:`install`, the guide's code trains data-parallel through a tfpar entry::

    import keras
    import tfpar

    tfpar.keras_distribution.install()   # The entry: 'allreduce' unless named here.
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = ...                           # Built, compiled and fit as on one device.

What it does, on the TensorFlow backend:

- a ``keras.distribution.DataParallel`` (by ``devices``, by a 1-D ``DeviceMesh``, or with
  neither: :func:`keras.distribution.list_devices`, the GPUs, else the logical CPU devices)
  set with ``set_distribution`` or entered with its ``scope()`` makes every model built while
  it is set train through the tfpar entry over its devices (``tf.distribute``'s strategy of
  the entry, made current as :func:`tf.distribute.experimental_set_strategy` makes one);
  ``fit``, ``evaluate`` and ``predict`` run as under the entry itself;
- the entry and its options are :func:`install`'s, or one distribution's through
  :class:`DataParallel` (``DataParallel(strategy="allreduce", virtual_replicas=4)``);
- what tfpar cannot do is refused in one line (:class:`~tfpar.errors.ConfigError`) and
  nothing is set: ``ModelParallel``, a mesh of more than one axis, a sharded
  ``distribute_tensor``, several processes (run the ``multi_worker*`` entries there).

The hook into Keras is :mod:`tfpar.compat.keras_distribution`'s (no public API serves).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfpar.compat import keras_distribution as keras_hook
from tfpar.errors import ConfigError
from tfpar.strategies import registry

DEFAULT_ENTRY = "allreduce"
"""The entry a ``keras.distribution.DataParallel`` trains through unless told otherwise: the
exact all-reduce step (every example weighs the same, every optimizer feature as on one
device)."""

_SUPPORTED = ("keras.distribution.DataParallel over a 1-D mesh of this process's devices, "
              "trained through a tfpar entry")


class _Choice:
    """The entry and options :func:`install` chose, and the strategy tfpar made current."""

    entry: str = DEFAULT_ENTRY
    options: dict[str, Any] = {}
    current: tf.distribute.Strategy | None = None


class DataParallel(keras.distribution.DataParallel):
    """``keras.distribution.DataParallel`` that names the tfpar entry it trains through.

    Args:
        device_mesh: As Keras's: a 1-D ``keras.distribution.DeviceMesh``.
        devices: As Keras's: device names (``["gpu:0", "gpu:1"]``, ``["cpu:0", "cpu:1"]``).
        auto_shard_dataset: As Keras's.
        strategy: The tfpar entry (:func:`tfpar.strategies.available`); ``None``: the one
            :func:`install` chose.
        **options: The entry's options (``virtual_replicas=4``, ``algorithm="ring"``, ...).

    Raises:
        RegistryError: If the entry or an option is unknown.
        TfparError: If the entry rejects an option's value.
    """

    def __init__(self, device_mesh: keras.distribution.DeviceMesh | None = None,
                 devices: list[str] | None = None, auto_shard_dataset: bool = True, *,
                 strategy: str | None = None, **options: Any) -> None:
        if strategy is not None or options:
            registry.choose(strategy or _Choice.entry, **options)  # Refused here, not at fit.
        if device_mesh is not None and getattr(device_mesh.devices, "ndim", 1) != 1:
            # Keras 3.15's own constructor fails on one (TypeError from its warning call).
            raise ConfigError(f"tfpar runs {_SUPPORTED}. Received: a mesh of shape "
                              f"{tuple(device_mesh.shape)} (axes {list(device_mesh.axis_names)}).")
        super().__init__(device_mesh=device_mesh, devices=devices,
                         auto_shard_dataset=auto_shard_dataset)
        self.strategy_name = strategy
        self.strategy_options = dict(options)


def install(strategy: str = DEFAULT_ENTRY, **options: Any) -> None:
    """Makes ``keras.distribution`` train through tfpar on the TensorFlow backend; idempotent
    (a second call changes the entry and options of the distributions set afterwards).

    A distribution already set when it is called takes effect for the models built after it.

    Args:
        strategy: The tfpar entry a ``keras.distribution.DataParallel`` trains through.
        **options: The entry's options.

    Raises:
        RegistryError: If the entry or an option is unknown.
        TfparError: If the entry rejects an option's value.
        ConfigError: If Keras runs another backend, or a Keras release tfpar was not verified
            against (the reason, in one line).
    """
    registry.choose(strategy, **options)
    reason = keras_hook.skip_reason()
    if reason:
        raise ConfigError(f"tfpar cannot run keras.distribution here: {reason}.")
    _Choice.entry, _Choice.options = strategy, dict(options)
    keras_hook.install(_on_set, {"get_device_count": _device_count,
                                 "num_processes": lambda: 1, "process_id": lambda: 0,
                                 "initialize": _initialize,
                                 "distribute_tensor": _distribute_tensor,
                                 "distribute_variable": _distribute_tensor,
                                 "distribute_data_input": _distribute_data_input})
    current = keras.distribution.distribution()
    if current is not None:
        _on_set(current)


def uninstall() -> None:
    """Leaves ``keras.distribution`` to Keras again; the strategy tfpar made current is left."""
    if _Choice.current is not None and tf.distribute.get_strategy() is _Choice.current:
        tf.distribute.experimental_set_strategy(None)
    _Choice.current = None
    keras_hook.uninstall()


def strategy_of(distribution: keras.distribution.Distribution) -> tf.distribute.Strategy:
    """The strategy a ``DataParallel`` trains through (made once per distribution).

    Raises:
        ConfigError: For a distribution tfpar cannot run (one line naming what it runs).
    """
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ConfigError(f"tfpar runs {_SUPPORTED}; {type(distribution).__name__} shards "
                          "variables or tensors, which it cannot. Received: "
                          f"{type(distribution).__name__}.")
    mesh = distribution.device_mesh
    if mesh.devices.ndim != 1:
        raise ConfigError(f"tfpar runs {_SUPPORTED}. Received: a mesh of shape "
                          f"{tuple(mesh.shape)} (axes {list(mesh.axis_names)}).")
    made = getattr(distribution, "_tfpar_strategy", None)
    if made is None:
        own_entry = getattr(distribution, "strategy_name", None)
        own_options = getattr(distribution, "strategy_options", {})
        entry = own_entry or _Choice.entry
        options = own_options if own_entry or own_options else _Choice.options
        made = registry.get(entry, [str(d) for d in mesh.devices.tolist()], **options)
        distribution._tfpar_strategy = made
    return made


def _on_set(value: keras.distribution.Distribution | None) -> None:
    """Before Keras sets ``value``: makes its strategy current (``None``: none)."""
    if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not _Choice.current:
        raise ConfigError("keras.distribution.set_distribution (or a distribution's scope) was "
                          "called inside a tf.distribute strategy's scope; set the distribution "
                          "outside it (tfpar makes the distribution's own strategy current).")
    strategy = None if value is None else strategy_of(value)
    tf.distribute.experimental_set_strategy(strategy)
    _Choice.current = strategy


def _device_count(device_type: str | None = None) -> int:
    return len(keras.distribution.list_devices(device_type))


def _initialize(job_addresses: Any = None, num_processes: int | None = None,
                process_id: int | None = None) -> None:
    if num_processes not in (None, 1):
        raise ConfigError(
            "keras.distribution on TensorFlow through tfpar runs in one process; across "
            "processes run the multi_worker or multi_worker_allreduce entry under tfpar-launch. "
            f"Received: num_processes={num_processes}.")


def _distribute_tensor(value: Any, layout: Any) -> Any:
    axes = getattr(layout, "axes", None)
    if axes is not None and any(axis is not None for axis in axes):
        raise ConfigError(f"tfpar runs {_SUPPORTED}, which replicates every tensor. Received: "
                          f"a layout sharded on axes {list(axes)}.")
    return value


def _distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: Any) -> Any:
    return per_process_batch
