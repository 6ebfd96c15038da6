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
- across processes (a job under ``tfpar-launch``, Slurm, Kubernetes or Ray, as the
  ``multi_worker*`` entries find it; or ``keras.distribution.initialize`` with every process's
  address), :func:`keras.distribution.list_devices` lists every process's devices
  (``cpu:0`` .. ``cpu:N-1``, process by process), and a ``DataParallel`` over all of them
  trains through the entry's multi-worker form (``allreduce``: ``multi_worker_allreduce``,
  ``mirrored``: ``multi_worker``) on this process's share; ``auto_shard_dataset=False`` leaves
  a ``tf.data`` input unsharded (each process reads its own);
- what tfpar cannot do is refused in one line (:class:`~tfpar.errors.ConfigError`) and
  nothing is set: ``ModelParallel``, a mesh of more than one axis, a sharded
  ``distribute_tensor``, a mesh of some processes' devices only.

The hook into Keras is :mod:`tfpar.compat.keras_distribution`'s (no public API serves).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import keras_distribution as keras_hook
from tfpar.errors import ConfigError
from tfpar.strategies import registry

DEFAULT_ENTRY = "allreduce"
"""The entry a ``keras.distribution.DataParallel`` trains through unless told otherwise: the
exact all-reduce step (every example weighs the same, every optimizer feature as on one
device)."""

_SUPPORTED = ("keras.distribution.DataParallel over a 1-D mesh of devices, trained through a "
              "tfpar entry")
_DISTRIBUTION = keras.distribution.DataParallel.__base__
"""Keras's base class of distributions (public as ``DataParallel``'s and ``ModelParallel``'s
base only)."""
_MULTI_WORKER = {"allreduce": "multi_worker_allreduce", "mirrored": "multi_worker"}
"""The entry a single-process entry's ``DataParallel`` trains through across processes."""


class _Choice:
    """The entry and options :func:`install` chose, the strategy tfpar made current, and, in a
    job of several processes, the job's one strategy."""

    entry: str = DEFAULT_ENTRY
    options: dict[str, Any] = {}
    current: tf.distribute.Strategy | None = None
    job: tf.distribute.Strategy | None = None


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
        RegistryError: If the entry or an option is unknown (an option's value is checked when
            the distribution is set, where its strategy is made).
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
    (a second call changes the entry and options of the ``DataParallel`` objects first set
    afterwards: one set before keeps the strategy it was given).

    A distribution already set when it is called takes effect for the models built after it.

    Args:
        strategy: The tfpar entry a ``keras.distribution.DataParallel`` trains through.
        **options: The entry's options.

    Raises:
        RegistryError: If the entry or an option is unknown (an option's value is checked when
            a distribution is set, where its strategy is made).
        ConfigError: If Keras runs another backend, or a Keras release tfpar was not verified
            against (the reason, in one line); or if the distribution already set is one tfpar
            cannot run (then nothing is installed).
    """
    registry.choose(strategy, **options)
    reason = keras_hook.skip_reason()
    if reason:
        raise ConfigError(f"tfpar cannot run keras.distribution here: {reason}.")
    _Choice.entry, _Choice.options = strategy, dict(options)
    keras_hook.install(_on_set, {"list_devices": list_devices,
                                 "get_device_count": _device_count,
                                 # What Keras asks to decide whether it splits the input
                                 # itself: TensorFlow's strategy splits it, so Keras never
                                 # does (it would split it twice); processes() tells the job.
                                 "num_processes": lambda: 1, "process_id": lambda: 0,
                                 "initialize": _initialize,
                                 "distribute_tensor": _distribute_tensor,
                                 "distribute_variable": _distribute_variable,
                                 "distribute_data_input": _distribute_data_input})
    if processes()[0] > 1:
        job_strategy()
    current = keras.distribution.distribution()
    if current is not None:
        try:
            _on_set(current)
        except Exception:
            uninstall()  # Refused: nothing installed, nothing set.
            raise


def uninstall() -> None:
    """Leaves ``keras.distribution`` to Keras again; the strategy tfpar made current is left."""
    if _Choice.current is not None and tf.distribute.get_strategy() is _Choice.current:
        tf.distribute.experimental_set_strategy(None)
    _Choice.current = None
    keras_hook.uninstall()


def processes() -> tuple[int, int]:
    """``(how many processes the job has, this one's index)``: its chief and workers as the
    ``multi_worker`` entries find them (``TF_CONFIG``, Slurm, Kubernetes), chief first;
    ``(1, 0)`` for a process alone."""
    resolver = cluster_spec.resolver("auto")
    if resolver is None:
        return 1, 0
    cluster = resolver.cluster_spec().as_dict()
    jobs = [job for job in ("chief", "worker") if cluster.get(job)]
    if not jobs:
        return 1, 0
    count = sum(len(cluster[job]) for job in jobs)
    before = len(cluster.get("chief", ())) if resolver.task_type == "worker" else 0
    return count, before + int(resolver.task_id)


def job_strategy() -> tf.distribute.Strategy:
    """The strategy of a job of several processes: the chosen entry's multi-worker form
    (``allreduce``: ``multi_worker_allreduce``, ``mirrored``: ``multi_worker``) over this
    process's devices (its GPUs, else its logical CPU devices), made once, before TensorFlow
    starts its context (which a multi-worker strategy must precede).

    Raises:
        ConfigError: For an entry that cannot span processes, or where TensorFlow started
            before (one line saying what to call first).
    """
    if _Choice.job is None:
        entry = _Choice.entry
        if not registry.entry(entry).multi_process:
            if entry not in _MULTI_WORKER:
                names = sorted({*_MULTI_WORKER, *_MULTI_WORKER.values()})
                raise ConfigError(f"Across processes a DataParallel trains through "
                                  f"{', '.join(names)}. Received: {entry!r}.")
            entry = _MULTI_WORKER[entry]
        try:
            _Choice.job = registry.get(entry, len(_local_devices()), **_Choice.options)
        except RuntimeError as e:  # "Collective ops must be configured at program startup".
            raise ConfigError(
                "Across processes tfpar makes the job's strategy before TensorFlow starts: call "
                "tfpar.keras_distribution.install() (and keras.distribution.initialize()) before "
                f"anything else runs TensorFlow. TensorFlow said: {e}") from None
    return _Choice.job


def _local_devices(device_type: str | None = None) -> list[str]:
    """This process's devices in Keras's words (``gpu:0``, ``cpu:1``), without starting
    TensorFlow: its GPUs, else its logical CPU devices."""
    kind = (device_type or ("gpu" if devices_lib.gpu_count() else "cpu")).lower()
    count = devices_lib.gpu_count() if kind == "gpu" else devices_lib.logical_cpu_count()
    return [f"{kind}:{i}" for i in range(count)]


def list_devices(device_type: str | None = None) -> list[str]:
    """``keras.distribution.list_devices`` through tfpar: Keras's list (the GPUs, else the
    logical CPU devices) in one process; across processes every process's, numbered process
    by process (each process has as many as this one)."""
    count, _ = processes()
    if count == 1:
        own = keras_hook.backend_function("list_devices")
        return list(own(device_type)) if own is not None else []
    local = _local_devices(device_type)
    if not local:
        return []
    job_strategy()
    kind = local[0].split(":")[0]
    return [f"{kind}:{i}" for i in range(count * len(local))]


def strategy_of(distribution: Any) -> tf.distribute.Strategy:
    """The strategy a ``DataParallel`` trains through (made once per distribution).

    Raises:
        ConfigError: For a distribution tfpar cannot run (one line naming what it runs).
    """
    if not isinstance(distribution, _DISTRIBUTION):
        raise ConfigError(f"set_distribution takes a keras.distribution.Distribution; tfpar "
                          f"runs {_SUPPORTED}. Received: {distribution!r}.")
    if isinstance(distribution, keras.distribution.ModelParallel):
        raise ConfigError(f"tfpar runs {_SUPPORTED}; {type(distribution).__name__} shards "
                          "variables or tensors, which it cannot. Received: "
                          f"{type(distribution).__name__}.")
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ConfigError(f"tfpar runs {_SUPPORTED}. Received: {type(distribution).__name__}.")
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
        devices = [str(d) for d in mesh.devices.tolist()]
        count, _ = processes()
        if count > 1:
            made = _across_processes(devices, count, own_entry, own_options)
        else:
            made = registry.get(entry, devices, **options)
        distribution._tfpar_strategy = made
    # Read by TfparStrategy.experimental_distribute_dataset. Across processes every
    # distribution shares the job's one strategy, so they must agree on it.
    auto_shard = bool(distribution.auto_shard_dataset)
    if processes()[0] > 1 and getattr(made, "tfpar_auto_shard", auto_shard) != auto_shard:
        raise ConfigError(
            "Across processes every DataParallel of a job trains through its one strategy, "
            "which reads the input one way: each must have the auto_shard_dataset of the first "
            f"({made.tfpar_auto_shard}). Received: auto_shard_dataset={auto_shard}.")
    made.tfpar_auto_shard = auto_shard
    return made


def _across_processes(devices: Sequence[str], count: int, own_entry: str | None,
                      own_options: dict[str, Any]) -> tf.distribute.Strategy:
    """The job's strategy, for a mesh of every process's devices."""
    devices = [_keras_name(name) for name in devices]
    every = list_devices(devices[0].split(":")[0] if devices else None)
    if sorted(devices) != sorted(every):
        raise ConfigError(f"Across {count} processes a DataParallel trains on every process's "
                          f"devices ({', '.join(every)}; keras.distribution.list_devices()). "
                          f"Received: {', '.join(devices)}.")
    if own_entry or own_options:
        raise ConfigError("Across processes a job has one strategy, made before TensorFlow "
                          "starts: name its entry and options in "
                          "tfpar.keras_distribution.install(), not in a DataParallel. "
                          f"Received: strategy={own_entry!r}, options={own_options}.")
    return job_strategy()


def _keras_name(name: str) -> str:
    """A device in Keras's words (``cpu:1``) for TensorFlow's local forms of it (``CPU:1``,
    ``/device:CPU:1``); a name of one task's device (``/job:...``) as it is."""
    if "/job:" in name:
        return name
    return name.removeprefix("/device:").lower()


def _on_set(value: Any) -> None:
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
    """``keras.distribution.initialize``: under a launcher or scheduler the job is what it set
    (the arguments, if given, must agree); else every process's address makes ``TF_CONFIG``."""
    addresses = (job_addresses.split(",") if isinstance(job_addresses, str)
                 else list(job_addresses or ()))
    count, index = processes()
    if count > 1:
        resolver = cluster_spec.resolver("auto")
        jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
        every = [address for job in ("chief", "worker") for address in jobs.get(job, ())]
        if (num_processes not in (None, count) or process_id not in (None, index)
                or (addresses and addresses != every)):
            raise ConfigError(
                f"This process is {index} of {count} ({', '.join(every)}) in the job its "
                f"launcher or scheduler set. Received: num_processes={num_processes}, "
                f"process_id={process_id}, job_addresses={job_addresses!r}.")
        return
    if num_processes is None and len(addresses) > 1:
        num_processes = len(addresses)
    if num_processes in (None, 1):
        return
    if len(addresses) != num_processes or process_id is None:
        raise ConfigError(
            "keras.distribution.initialize of several processes needs every process's "
            "host:port (job_addresses, or KERAS_DISTRIBUTION_JOB_ADDRESSES) and this one's "
            f"process_id. Received: {len(addresses)} addresses for num_processes="
            f"{num_processes}, process_id={process_id}.")
    config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": process_id}}
    cluster_spec.parse_tf_config(json.dumps(config))  # One line if malformed.
    os.environ["TF_CONFIG"] = json.dumps(config)
    job_strategy()


def _distribute_tensor(value: Any, layout: Any) -> Any:
    axes = getattr(layout, "axes", None)
    if axes is not None and any(axis is not None for axis in axes):
        raise ConfigError(f"tfpar runs {_SUPPORTED}, which replicates every tensor. Received: "
                          f"a layout sharded on axes {list(axes)}.")
    return value


def _distribute_variable(value: Any, layout: Any) -> Any:
    """A variable's own layout, made while a distribution is set: replicated, or refused."""
    if keras.distribution.distribution() is not None:
        _distribute_tensor(value, layout)
    return value


def _distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: Any) -> Any:
    return per_process_batch
