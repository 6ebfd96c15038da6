"""The strategy registry: names such as ``mirrored`` resolve to a ready ``tf.distribute`` strategy.

No TensorFlow at import: listing the entries (``--list_strategies``, ``--help``, ``tfpar-env``)
and checking a name or an option answer at once; :func:`get` imports it.

An entry pairs a factory ``factory(devices, **options) -> tf.distribute.Strategy`` with what
the rest of tfpar needs to know about it: a description, whether it spans several processes,
how many devices it takes. Every entry trains with plain ``model.fit``; the ``allreduce``
entries make ``fit`` run tfpar's hand-written step (:mod:`tfpar.allreduce`). The built-in
entries are in :mod:`tfpar.strategies.builtin`.

:func:`choose` resolves a name and options once into a :class:`StrategyChoice`, the value a
run passes around (``TrainConfig`` holds one); its ``build(devices)`` makes the strategy, and
:func:`get` does both. What a built strategy was made from is kept in the registry, never on
the TensorFlow object: :func:`selection` returns it. Users add entries with
:func:`register` (also a decorator); other packages add them through the ``tfpar.strategies``
entry-point group, whose entries load a :class:`StrategyEntry` or a factory (registered under
the entry point's name, described by the first line of its docstring).

The registry is a map from names to factories; what a strategy does when it is built (Keras's
fixes, checking ``TF_CONFIG``, waiting for peers) is its factory's and its class's
(:class:`tfpar.strategies.base.TfparStrategy`).

Example::

    strategy = tfpar.strategies.get("mirrored", devices=2)
    with strategy.scope():
        model = ...
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING
from typing import Any

from tfpar import worker_contract
from tfpar.errors import RegistryError

if TYPE_CHECKING:
    import tensorflow as tf

    from tfpar import devices as devices_lib

ENTRY_POINT_GROUP = "tfpar.strategies"
"""The entry-point group through which installed packages register strategies (plugins)."""

Factory = Callable[..., "tf.distribute.Strategy"]


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
    max_devices: int | None = None
    requires_gpu: bool = False
    logs_exact_loss: bool = True

    def options(self) -> dict[str, Any]:
        """Returns the keyword options the factory accepts, with their defaults."""
        params = list(inspect.signature(self.factory).parameters.values())[1:]
        return {p.name: p.default for p in params
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


_REGISTRY: dict[str, StrategyEntry] = {}
_entry_points_loaded = False


def register(name: str, factory: Factory | None = None, *, description: str = "",
             multi_process: bool = False,
             max_devices: int | None = None, requires_gpu: bool = False,
             logs_exact_loss: bool = True, override: bool = False) -> Any:
    """Registers a strategy factory under ``name``; usable as a decorator.

    Args:
        name: The registry name.
        factory: ``factory(devices, **options)`` returning a ``tf.distribute.Strategy``.
            Omit it to use ``register`` as a decorator.
        description: One line; defaults to the first line of the factory's docstring.
        multi_process: Whether the strategy spans several processes.
        max_devices: The most devices one process may give it (``None``: no limit).
        requires_gpu: Whether it only runs on GPUs.
        logs_exact_loss: Whether the running loss Keras logs under it is right.
        override: Replace an existing entry of the same name instead of raising.

    Returns:
        The factory (so the decorator leaves the function usable), or the decorator.

    Raises:
        RegistryError: If ``name`` is taken and ``override`` is false, or an argument is invalid.
    """
    if factory is None:
        return lambda f: register(name, f, description=description,
                                  multi_process=multi_process, max_devices=max_devices,
                                  requires_gpu=requires_gpu, logs_exact_loss=logs_exact_loss,
                                  override=override)
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
                                    requires_gpu, logs_exact_loss)
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
    """What a strategy from :func:`get` was made from (see :func:`selection`).

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


# Strategy -> what it was made from; weak, so a strategy's record goes with it.
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Options(dict):
    """A choice's options: a dict that refuses changes (unlike a mapping proxy, it copies, so
    ``dataclasses.asdict`` of a config holding a choice works)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("A StrategyChoice's options are read-only: use with_options(...).")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:
        return _Options, (dict(self),)


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """A registry entry and its options, checked: the user's choice of strategy as a value.

    Made by :func:`choose`; ``build(devices)`` makes the strategy. Everything a run needs to
    know about the strategy before it exists is here, so nothing looks the name up again.

    Attributes:
        entry: The registry entry.
        options: Its options, the factory's defaults filled in (read-only).
    """

    entry: StrategyEntry
    options: Mapping[str, Any]

    @property
    def name(self) -> str:
        """The entry's registry name."""
        return self.entry.name

    @property
    def multi_process(self) -> bool:
        """Whether the strategy spans several processes (workers)."""
        return self.entry.multi_process

    @property
    def runs_allreduce_step(self) -> bool:
        """Whether the strategy trains with tfpar's hand-written all-reduce step (the entries
        that take its ``accumulation_steps`` option)."""
        return "accumulation_steps" in self.options

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StrategyChoice):
            return NotImplemented
        return (self.entry, dict(self.options)) == (other.entry, dict(other.options))

    def __hash__(self) -> int:  # The options are a read-only dict, not hashable itself.
        return hash((self.entry.name, repr(sorted(self.options.items()))))

    def one_process_per_device(self) -> StrategyChoice:
        """The multi-worker entry with the same training step (one worker process per
        device): ``multi_worker_allreduce`` for tfpar's step, else ``multi_worker``."""
        return choose("multi_worker_allreduce" if self.runs_allreduce_step else "multi_worker")

    @property
    def micro_batches(self) -> int:
        """Micro-batches per training step: the entry's ``accumulation_steps`` option (the
        registry's name for it), else 1."""
        return int(self.options.get("accumulation_steps", 1))

    @property
    def virtual_replicas(self) -> int:
        """The shards every batch is cut into, the same on any number of devices and workers
        (world-size invariance): the entry's ``virtual_replicas`` option, else 0 (off)."""
        return int(self.options.get("virtual_replicas") or 0)

    def with_options(self, **options: Any) -> StrategyChoice:
        """Returns this choice with ``options`` changed.

        Raises:
            RegistryError: If the entry has no such option.
        """
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise RegistryError(f"Strategy {self.name!r} has no option(s) {', '.join(unknown)}. "
                                f"Its options: {', '.join(self.options) or 'none'}.")
        return dataclasses.replace(self, options=_Options({**self.options,
                                                                         **options}))

    def build(self, devices: devices_lib.DeviceSpec = 1) -> tf.distribute.Strategy:
        """Returns the strategy: the entry's factory over ``devices`` with the options.

        Args:
            devices: A device set, a count or device names (see
                :func:`tfpar.devices.resolve`).

        Raises:
            RegistryError: If the entry takes fewer devices.
            DeviceError: If the device set cannot be provided.
            TfparError: If the entry rejects an option's value.
            TypeError: If the factory does not return a strategy.
        """
        import tensorflow as tf  # Imported here: choosing an entry does not need it.

        from tfpar import devices as devices_lib
        from tfpar.host import onednn

        onednn.warn_if_too_late()  # Once: TensorFlow started before tfpar could choose.
        device_set = devices_lib.resolve(devices)
        if self.entry.max_devices is not None and len(device_set) > self.entry.max_devices:
            raise RegistryError(f"Strategy {self.name!r} runs on at most "
                                f"{self.entry.max_devices} device(s). Received: {device_set}. "
                                "Use 'mirrored' or 'allreduce' for more.")
        if self.entry.multi_process:
            # Under a launcher, the job's shape (the world sizes it can run on), declared before
            # the factory waits for the other workers: a peer lost meanwhile is decided on it.
            worker_contract.declare(replicas_per_worker=len(device_set),
                                    virtual_replicas=self.virtual_replicas)
        strategy = self.entry.factory(device_set, **self.options)
        if not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(f"The factory of strategy {self.name!r} returned {strategy!r}, not "
                            "a tf.distribute.Strategy.")
        _MADE[strategy] = Selection(self.entry, dict(self.options), device_set)
        return strategy


def choose(name: str, **options: Any) -> StrategyChoice:
    """Resolves a strategy name and its options into a :class:`StrategyChoice`.

    Args:
        name: A registered strategy name (see :func:`available`).
        **options: Options of that entry (see ``entry(name).options()``).

    Returns:
        The choice, its options completed with the entry's defaults.

    Raises:
        RegistryError: If the name or an option is unknown.
    """
    chosen = entry(name)
    return StrategyChoice(chosen, _Options(chosen.options())).with_options(
        **options)


def selection(strategy: tf.distribute.Strategy) -> Selection:
    """Returns what ``strategy`` was made from.

    Raises:
        RegistryError: If ``strategy`` did not come from :func:`get` or
            :meth:`StrategyChoice.build`.
    """
    try:
        return _MADE[strategy]
    except (KeyError, TypeError):
        raise RegistryError("This strategy did not come from tfpar.strategies.get, so tfpar "
                            "does not know its registry entry. Obtain it with "
                            f"tfpar.strategies.get(name, devices). Received: {strategy!r}."
                            ) from None


def get(name: str, devices: devices_lib.DeviceSpec = 1, **options: Any
        ) -> tf.distribute.Strategy:
    """Returns a ready strategy: the named entry built over ``devices``
    (``choose(name, **options).build(devices)``).

    Args:
        name: A registered strategy name (see :func:`available`).
        devices: A device set, a count or device names (see :func:`tfpar.devices.resolve`).
        **options: Options of that entry (see ``entry(name).options()``).

    Returns:
        The ``tf.distribute.Strategy``; :func:`selection` tells what it was made from.

    Raises:
        RegistryError: If the name or an option is unknown.
        DeviceError: If the device set cannot be provided.
        TfparError: If the entry rejects an option's value.
        TypeError: If the factory does not return a strategy.
    """
    return choose(name, **options).build(devices)
