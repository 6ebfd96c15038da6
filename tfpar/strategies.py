"""The strategy registry: names such as ``mirrored`` resolve to a ready ``tf.distribute`` strategy.

An entry pairs a factory ``factory(devices, **options) -> tf.distribute.Strategy`` with what
the rest of tfpar needs to know about it: a description, whether it spans several processes,
how many devices it takes. Every entry trains with plain ``model.fit``; the ``allreduce``
entries make ``fit`` run tfpar's hand-written step (:mod:`tfpar.allreduce_strategy`).

:func:`get` returns the strategy with what it was made from attached: ``strategy.tfpar`` is a
:class:`Selection` (the entry, its options, the device set), so nothing downstream looks the
entry up by name again or passes options beside the strategy. Users add entries with :func:`register` (also a decorator); other
packages add them through the ``tfpar.strategies`` entry-point group, whose entries load a
:class:`StrategyEntry` or a factory (registered under the entry point's name, described by the
first line of its docstring).

Example::

    strategy = tfpar.strategies.get("mirrored", devices=2)
    with strategy.scope():
        model = ...
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from importlib import metadata
from typing import Any, Callable, Optional

import tensorflow as tf

from tfpar import allreduce
from tfpar import allreduce_strategy
from tfpar import cluster as cluster_lib
from tfpar import devices as devices_lib
from tfpar import keras_fixes
from tfpar.errors import ConfigError
from tfpar.errors import RegistryError

ENTRY_POINT_GROUP = "tfpar.strategies"

Factory = Callable[..., tf.distribute.Strategy]


@dataclasses.dataclass(frozen=True)
class StrategyEntry:
    """One registry entry.

    Attributes:
        name: The name users select it by (``--strategy=name``).
        factory: ``factory(devices: DeviceSet, **options) -> tf.distribute.Strategy``.
        description: One line for listings and ``--help``.
        multi_process: Whether the strategy spans several processes (workers).
        max_devices: The most devices one process may give it (``None``: no limit).
        requires_gpu: Whether it only runs on GPUs.
        logs_exact_loss: Whether the running loss Keras logs under it is right (Keras 3
            miscomputes it under ``CentralStorageStrategy``, whose training is still exact).
    """

    name: str
    factory: Factory
    description: str = ""
    multi_process: bool = False
    max_devices: Optional[int] = None
    requires_gpu: bool = False
    logs_exact_loss: bool = True

    def options(self) -> dict[str, Any]:
        """Returns the keyword options the factory accepts, with their defaults."""
        params = list(inspect.signature(self.factory).parameters.values())[1:]
        return {p.name: p.default for p in params
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


_REGISTRY: dict[str, StrategyEntry] = {}
_entry_points_loaded = False


def register(name: str, factory: Optional[Factory] = None, *, description: str = "",
             multi_process: bool = False,
             max_devices: Optional[int] = None, requires_gpu: bool = False,
             override: bool = False):
    """Registers a strategy factory under ``name``; usable as a decorator.

    Args:
        name: The registry name.
        factory: ``factory(devices, **options)`` returning a ``tf.distribute.Strategy``.
            Omit it to use ``register`` as a decorator.
        description: One line; defaults to the first line of the factory's docstring.
        multi_process: Whether the strategy spans several processes.
        max_devices: The most devices one process may give it (``None``: no limit).
        requires_gpu: Whether it only runs on GPUs.
        override: Replace an existing entry of the same name instead of raising.

    Returns:
        The factory (so the decorator leaves the function usable), or the decorator.

    Raises:
        RegistryError: If ``name`` is taken and ``override`` is false, or an argument is invalid.
    """
    if factory is None:
        return lambda f: register(name, f, description=description,
                                  multi_process=multi_process, max_devices=max_devices,
                                  requires_gpu=requires_gpu, override=override)
    if not isinstance(name, str) or not name.isidentifier():
        raise RegistryError("A strategy name must be a non-empty identifier such as "
                            f"'my_strategy'. Received: name={name!r}.")
    if not callable(factory):
        raise RegistryError(f"factory must be callable. Received: factory={factory!r}.")
    if name in _REGISTRY and not override:
        raise RegistryError(f"A strategy named {name!r} is already registered; pass "
                            "override=True to replace it.")
    if not description:
        description = (inspect.getdoc(factory) or "").split("\n")[0]
    _REGISTRY[name] = StrategyEntry(name, factory, description, multi_process, max_devices,
                                    requires_gpu)
    return factory


def unregister(name: str) -> None:
    """Removes an entry (for tests and plugins that replace themselves).

    Raises:
        RegistryError: If there is no such entry.
    """
    entry(name)
    del _REGISTRY[name]


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        loaded = ep.load()
        if isinstance(loaded, StrategyEntry):
            _REGISTRY[ep.name] = dataclasses.replace(loaded, name=ep.name)
        else:
            register(ep.name, loaded)


def available() -> dict[str, str]:
    """Returns ``{name: description}`` of every registered strategy, sorted by name."""
    _load_entry_points()
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def entry(name: str) -> StrategyEntry:
    """Returns the registry entry for ``name``.

    Raises:
        RegistryError: If no strategy has that name (the message lists those that exist).
    """
    _load_entry_points()
    if name not in _REGISTRY:
        raise RegistryError(f"Unknown strategy {name!r}. Available strategies: "
                            f"{', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a strategy from :func:`get` was made from; attached to it as ``strategy.tfpar``.

    Attributes:
        entry: The registry entry.
        options: The options it was given (the factory's defaults filled in).
        devices: The local device set.
    """

    entry: StrategyEntry
    options: dict[str, Any]
    devices: devices_lib.DeviceSet

    @property
    def name(self) -> str:
        """The entry's registry name."""
        return self.entry.name


def selection(strategy: tf.distribute.Strategy) -> Selection:
    """Returns what ``strategy`` was made from (its ``tfpar`` attribute).

    Raises:
        RegistryError: If ``strategy`` did not come from :func:`get`.
    """
    chosen = getattr(strategy, "tfpar", None)
    if not isinstance(chosen, Selection):
        raise RegistryError("This strategy did not come from tfpar.strategies.get, so tfpar does "
                            "not know its registry entry. Obtain it with "
                            f"tfpar.strategies.get(name, devices). Received: {strategy!r}.")
    return chosen


def get(name: str, devices: devices_lib.DeviceSpec = 1, **options) -> tf.distribute.Strategy:
    """Returns a ready strategy: the named entry built over ``devices``.

    The strategy carries what it was made from: ``strategy.tfpar`` is a :class:`Selection`.

    Args:
        name: A registered strategy name (see :func:`available`).
        devices: A device set, a count or device names (see :func:`tfpar.devices.resolve`).
        **options: Options of that entry (see ``entry(name).options()``).

    Returns:
        The ``tf.distribute.Strategy``.

    Raises:
        RegistryError: If the name or an option is unknown.
        DeviceError: If the device set cannot be provided.
        TfparError: If the entry rejects an option's value.
        TypeError: If the factory does not return a strategy.
    """
    chosen = entry(name)
    allowed = chosen.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RegistryError(f"Strategy {name!r} has no option(s) {', '.join(unknown)}. Its options: "
                            f"{', '.join(allowed) or 'none'}.")
    device_set = devices_lib.resolve(devices)
    if chosen.max_devices is not None and len(device_set) > chosen.max_devices:
        raise RegistryError(f"Strategy {name!r} runs on at most {chosen.max_devices} device(s). "
                            f"Received: {device_set}. Use 'mirrored' or 'allreduce' for more.")
    if os.environ.get("TF_CONFIG"):
        # TensorFlow's strategies (mirrored ones too) parse TF_CONFIG and fail with a JSON
        # traceback on a malformed one: check it first, whatever the entry.
        cluster_lib.parse_tf_config(os.environ["TF_CONFIG"])
    keras_fixes.install()
    strategy = chosen.factory(device_set, **options)
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"The factory of strategy {name!r} returned {strategy!r}, not a "
                        "tf.distribute.Strategy.")
    strategy.tfpar = Selection(chosen, {**allowed, **options}, device_set)
    return strategy


@register("default", max_devices=1)
def _default(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """No distribution: TensorFlow's default strategy and placement (one device)."""
    return tf.distribute.get_strategy()


@register("one_device", max_devices=1)
def _one_device(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """OneDeviceStrategy: everything placed on the one device of the set."""
    return tf.distribute.OneDeviceStrategy(devices.tf_names[0])


CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")


def make_cross_device_ops(kind: str, devices: devices_lib.DeviceSet) -> tf.distribute.CrossDeviceOps:
    """Returns the cross-device reduction for a device set.

    Args:
        kind: One of ``CROSS_DEVICE_OPS``. ``"auto"`` picks NCCL when every device is a GPU
            (the fast path on GPUs) and otherwise reduces on one device, which is what works
            for CPUs and mixed CPU/GPU sets.
        devices: The devices being reduced over.

    Returns:
        The ``tf.distribute.CrossDeviceOps`` instance.

    Raises:
        RegistryError: If ``kind`` is unknown, or NCCL is asked for on a set with non-GPUs.
    """
    if kind not in CROSS_DEVICE_OPS:
        raise RegistryError(f"Unknown cross_device_ops {kind!r}. Allowed: "
                            f"{', '.join(CROSS_DEVICE_OPS)}.")
    if kind == "auto":
        kind = "nccl" if devices.is_gpu_only and len(devices) > 1 else "reduction_to_one_device"
    if kind in ("nccl", "hierarchical_copy") and not devices.is_gpu_only:
        raise RegistryError(f"cross_device_ops={kind!r} needs GPUs only; {devices} has other "
                            "devices. Use 'reduction_to_one_device' or 'auto'.")
    if kind == "nccl":
        return tf.distribute.NcclAllReduce()
    if kind == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


@register("mirrored")
def _mirrored(devices: devices_lib.DeviceSet, cross_device_ops: str = "auto"
              ) -> tf.distribute.Strategy:
    """MirroredStrategy: one replica per device, gradients all-reduced, model.fit."""
    return tf.distribute.MirroredStrategy(
        devices.tf_names, cross_device_ops=make_cross_device_ops(cross_device_ops, devices))


class _CentralStorageStrategy(tf.distribute.experimental.CentralStorageStrategy):
    """``CentralStorageStrategy`` that refuses Keras's ``evaluate``, which miscounts under it."""

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``; raises for Keras's own ``test_step`` (evaluate, validation)."""
        if allreduce_strategy.is_keras_step(fn, "test_step"):
            # Keras 3 updates its metrics' variables wrongly under this strategy: evaluate()
            # returned loss 1.0958 and accuracy 0.50 where the same weights score 1.0857 and
            # 0.583 (tests/fit_interface_test.py).
            raise ConfigError("model.evaluate (and fit's validation_data) give wrong loss and "
                              "metrics under 'central_storage' in Keras 3. Evaluate outside "
                              "the strategy (a copy of the model, or tfpar.evaluation."
                              "accuracy), or train with 'mirrored' or 'allreduce'.")
        return super().run(fn, args=args, kwargs=kwargs, options=options)


def _central_storage(devices: devices_lib.DeviceSet) -> tf.distribute.Strategy:
    """CentralStorageStrategy: variables on one device (the CPU for GPU sets), compute mirrored."""
    parameter_device = "/device:CPU:0" if devices.is_gpu_only else devices.tf_names[0]
    return _CentralStorageStrategy(compute_devices=devices.tf_names,
                                   parameter_device=parameter_device)


# Keras 3's loss tracker updates its variables wrongly under this strategy: the running loss
# it logs is wrong after the first step (the weights train exactly; tested).
_REGISTRY["central_storage"] = StrategyEntry(
    "central_storage", _central_storage, inspect.getdoc(_central_storage).split("\n")[0],
    logs_exact_loss=False)


def _step_options(algorithm, bytes_per_pack, split_weights, gradient_compression,
                  accumulation_steps) -> allreduce_strategy.StepOptions:
    return allreduce_strategy.StepOptions(
        algorithm, bytes_per_pack, None if split_weights is None else tuple(split_weights),
        gradient_compression, accumulation_steps)


@register("allreduce")
def _allreduce(devices: devices_lib.DeviceSet, algorithm: str = "collective",
               bytes_per_pack: int = allreduce.DEFAULT_BYTES_PER_PACK,
               split_weights: Optional[tuple[float, ...]] = None,
               gradient_compression: str = "none", accumulation_steps: int = 1,
               cross_device_ops: str = "auto") -> tf.distribute.Strategy:
    """Hand-written exact step in model.fit: split batch, per-replica backward, all-reduce (collective|naive|ring), update."""
    return allreduce_strategy.AllReduceStrategy(
        devices.tf_names, make_cross_device_ops(cross_device_ops, devices),
        _step_options(algorithm, bytes_per_pack, split_weights, gradient_compression,
                      accumulation_steps))


_IMPLEMENTATIONS = ("auto", "ring", "nccl")



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


def _make_multi_worker(strategy_class: type, devices: devices_lib.DeviceSet,
                       implementation: str, cluster: str,
                       worker_hosts: Optional[tuple[str, ...]], task_index: Optional[int],
                       cluster_timeout: float, bytes_per_pack: int = 0,
                       **extra) -> tf.distribute.Strategy:
    """Checks the options, waits for the cluster (see ``cluster.connect``), builds the strategy."""
    if implementation not in _IMPLEMENTATIONS:
        raise RegistryError(f"Unknown collective implementation {implementation!r}. Allowed: "
                            f"{', '.join(_IMPLEMENTATIONS)}.")
    if implementation == "nccl" and not devices.is_gpu_only:
        raise RegistryError(f"implementation='nccl' needs GPUs; {devices} has other devices. "
                            "Use 'ring' or 'auto'.")
    if not devices.is_gpu_only and len(devices) != 1:
        raise RegistryError("On CPUs each multi_worker process runs one replica; use one device "
                            f"per worker and more workers. Received: {devices}.")
    if isinstance(cluster_timeout, bool) or not (isinstance(cluster_timeout, (int, float))
                                                 and cluster_timeout > 0):
        raise ConfigError(f"cluster_timeout must be a positive number of seconds. Received: "
                          f"{cluster_timeout!r}.")
    resolver = cluster_lib.resolver(cluster, worker_hosts, task_index)
    _leave_a_thread_for_collectives()
    if devices.is_gpu_only:  # The strategy uses every visible GPU: show it only the set.
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices([gpus[int(n.split(":")[1])] for n in devices], "GPU")
    kind = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[implementation]
    allreduce.check_bytes_per_pack(bytes_per_pack, "one all-reduce of every gradient")
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack,
                                                              implementation=kind)
    return cluster_lib.connect(
        lambda: strategy_class(cluster_resolver=resolver, communication_options=options, **extra),
        resolver, cluster_timeout)


@register("multi_worker", multi_process=True)
def _multi_worker(devices: devices_lib.DeviceSet, implementation: str = "auto",
                  cluster: str = "auto", worker_hosts: Optional[tuple[str, ...]] = None,
                  task_index: Optional[int] = None,
                  cluster_timeout: float = cluster_lib.DEFAULT_TIMEOUT_SECONDS,
                  bytes_per_pack: int = allreduce.DEFAULT_BYTES_PER_PACK
                  ) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy: every worker process (TF_CONFIG, SLURM or --worker_hosts), one replica per local device."""
    # TensorFlow packs the gradients from the last layer to the first into buckets of this
    # size, each all-reduced as soon as it is ready (its default, 0, waits for all of them).
    return _make_multi_worker(tf.distribute.MultiWorkerMirroredStrategy, devices, implementation,
                              cluster, worker_hosts, task_index, cluster_timeout,
                              bytes_per_pack=bytes_per_pack)


@register("multi_worker_allreduce", multi_process=True)
def _multi_worker_allreduce(devices: devices_lib.DeviceSet, implementation: str = "auto",
                            cluster: str = "auto", worker_hosts: Optional[tuple[str, ...]] = None,
                            task_index: Optional[int] = None,
                            cluster_timeout: float = cluster_lib.DEFAULT_TIMEOUT_SECONDS,
                            bytes_per_pack: int = allreduce.DEFAULT_BYTES_PER_PACK,
                            gradient_compression: str = "none", accumulation_steps: int = 1
                            ) -> tf.distribute.Strategy:
    """multi_worker with the hand-written exact step in model.fit (collective all-reduce across workers)."""
    return _make_multi_worker(allreduce_strategy.MultiWorkerAllReduceStrategy, devices,
                              implementation, cluster, worker_hosts, task_index, cluster_timeout,
                              step_options=_step_options("collective", bytes_per_pack, None,
                                                         gradient_compression,
                                                         accumulation_steps))
