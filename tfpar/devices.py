"""Device sets: the devices one training run uses, and simulating them on a CPU.

A device set is written as a count (``2``) or as names (``GPU:0,GPU:1``, ``CPU:0,CPU:1``).
A count uses that many GPUs when the machine has them; otherwise the CPU is split into that
many logical devices, which must happen before TensorFlow initialises its runtime. So callers
that will need several device sets in one process call :func:`resolve` for the largest first
(``tfpar-train`` does), or call :func:`ensure_logical_cpus` at start-up.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Union

import tensorflow as tf
from absl import logging

from tfpar.errors import DeviceError
from tfpar.host import thread_layouts
from tfpar.host.machine import MAX_LOGICAL_CPUS

_NAME_RE = re.compile(r"^(?:/(?:job:[\w-]+/)?(?:replica:\d+/)?(?:task:\d+/)?device:)?"
                      r"(?P<type>cpu|gpu):(?P<index>\d+)$", re.IGNORECASE)

DeviceSpec = Union[int, str, Sequence[str], "DeviceSet"]


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """An ordered set of local devices that one strategy replicates a model over.

    Attributes:
        names: Short device names, e.g. ``("CPU:0", "CPU:1")``.
    """

    names: tuple[str, ...]

    def __post_init__(self):
        if not self.names:
            raise DeviceError("A device set needs at least one device. Received: names=().")

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __str__(self) -> str:
        return "[" + ", ".join(self.names) + "]"

    @property
    def tf_names(self) -> list[str]:
        """Full TensorFlow device names, e.g. ``["/device:CPU:0"]``."""
        return [f"/device:{name}" for name in self.names]

    @property
    def device_types(self) -> frozenset[str]:
        """The device types in the set, e.g. ``{"CPU"}``."""
        return frozenset(name.split(":")[0] for name in self.names)

    @property
    def is_gpu_only(self) -> bool:
        """Whether every device of the set is a GPU."""
        return self.device_types == {"GPU"}


def _cpu() -> tf.config.PhysicalDevice:
    return tf.config.list_physical_devices("CPU")[0]


def logical_cpu_count() -> int:
    """Returns the number of logical CPU devices configured (1 when the CPU is not split).

    Unlike ``tf.config.list_logical_devices``, this does not initialise TensorFlow.
    """
    config = tf.config.get_logical_device_configuration(_cpu())
    return len(config) if config else 1


def gpu_count() -> int:
    """Returns the number of (logical) GPUs, without initialising TensorFlow."""
    count = 0
    for gpu in tf.config.list_physical_devices("GPU"):
        config = tf.config.get_logical_device_configuration(gpu)
        count += len(config) if config else 1
    return count


PER_DEVICE_THREAD_POOLS_ENV = thread_layouts.PER_DEVICE_THREAD_POOLS_ENV
"""Makes every logical CPU device own its intra-op thread pool instead of sharing the process's one
pool. Read by TensorFlow once, when it creates its devices. No public API sets it.
"""


def _check_split(count: int, threads_per_device: int | None) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LOGICAL_CPUS:
        raise DeviceError(f"The number of logical CPU devices must be an integer from 1 to "
                          f"{MAX_LOGICAL_CPUS}. Received: count={count!r}.")
    if threads_per_device is not None and (isinstance(threads_per_device, bool)
                                           or not isinstance(threads_per_device, int)
                                           or threads_per_device < 1):
        raise DeviceError("threads_per_device must be an integer >= 1. Received: "
                          f"threads_per_device={threads_per_device!r}.")


def ensure_logical_cpus(count: int, threads_per_device: int | None = None, *,
                        layout: thread_layouts.ThreadLayout | None = None) -> None:
    """Splits the CPU into at least ``count`` logical devices, each with its own threads.

    By default logical CPU devices share one pool of intra-op threads: two replicas each with
    one thread then take turns on that one thread (no faster than one device), and with more
    threads they fight over all cores. So when
    this function splits the CPU into ``n > 1`` devices it lays the threads out as this
    machine kind was tuned to (``tfpar-benchmark --tune``, :mod:`tfpar.host.thread_layouts`),
    or else by default gives each device a pool of its own (``TF_OVERRIDE_GLOBAL_THREADPOOL=1``,
    unless that variable is set already) of ``cores // n`` intra-op threads, and ``n``
    inter-op threads to drive the replicas side by side. A logical device is then like one
    GPU: one unit of compute.

    Thread counts the user set already (``tf.config.threading``) are kept unless
    ``threads_per_device`` or ``layout`` is given; the pools are per device either way unless
    the layout says otherwise.

    Args:
        count: How many logical CPU devices are needed (``CPU:0`` .. ``CPU:{count-1}``).
        threads_per_device: Intra-op threads of each device. ``None``: the tuned or default
            layout's when the CPU is split now, else leave the threads alone. With
            ``count=1`` this pins an unsplit CPU to that many threads.
        layout: The whole layout to use (threads, pools, inter-op threads), e.g. a candidate
            being timed; overrides ``threads_per_device``.

    Raises:
        DeviceError: If ``count`` or ``threads_per_device`` is out of range, or TensorFlow
            has already initialised with fewer logical CPU devices (the split must come
            first), or with other threads than asked for.
    """
    _check_split(count, threads_per_device)
    have = logical_cpu_count()
    if have < count:
        try:
            tf.config.set_logical_device_configuration(
                _cpu(), [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
        except RuntimeError as e:
            raise DeviceError(
                f"Cannot split the CPU into {count} logical devices: TensorFlow has already "
                f"initialised with {have} (available: {_describe_available()}). Ask for the "
                f"largest device set first, call tfpar.devices.ensure_logical_cpus({count}) "
                f"before any TensorFlow op runs, or in pytest pass --tfpar-devices={count}."
            ) from e
        if layout is None and threads_per_device is None:
            layout = thread_layouts.for_split(count)
        if count > 1:
            thread_layouts.use_pools(layout)
    if layout is None and threads_per_device is not None:
        layout = thread_layouts.ThreadLayout(threads_per_device)
    if layout is None:
        return
    try:
        thread_layouts.apply(layout, count, least_inter_op=have)
    except RuntimeError as e:
        raise DeviceError(f"Cannot give each CPU device {layout.threads_per_device} "
                          "thread(s): TensorFlow has already initialised. Call "
                          "tfpar.devices.ensure_logical_cpus first.") from e


def split_gpu(count: int, memory_limit_mb: int) -> None:
    """Splits the first physical GPU into ``count`` logical GPUs of ``memory_limit_mb`` each.

    Args:
        count: Number of logical GPUs to make from GPU 0.
        memory_limit_mb: Memory of each logical GPU, in MiB.

    Raises:
        DeviceError: If there is no GPU, the arguments are out of range, or TensorFlow has
            already initialised.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise DeviceError("Cannot split a GPU: this machine has none (available: "
                          f"{_describe_available()}).")
    if count < 1 or memory_limit_mb < 1:
        raise DeviceError("split_gpu needs count >= 1 and memory_limit_mb >= 1. Received: "
                          f"count={count}, memory_limit_mb={memory_limit_mb}.")
    try:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
                      for _ in range(count)])
    except RuntimeError as e:
        raise DeviceError("Cannot split GPU:0 into logical GPUs: TensorFlow has already "
                          "initialised. Split it before any TensorFlow op runs.") from e


def _describe_available() -> str:
    gpus = gpu_count()
    text = f"{logical_cpu_count()} logical CPU device(s)"
    return text + (f", {gpus} GPU(s)" if gpus else ", no GPU")


def parse(text: str) -> int | tuple[str, ...]:
    """Parses a device-set spec as written on a command line.

    Args:
        text: A positive count (``"2"``) or comma-separated names (``"CPU:0,CPU:1"``).

    Returns:
        The count as an ``int``, or the names as a tuple of strings.

    Raises:
        DeviceError: If the text is neither.
    """
    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise DeviceError("A device set is a positive count such as 2, or device names such "
                          f"as CPU:0,CPU:1 or GPU:0,GPU:1. Received: {text!r}.")
    return names


def resolve(spec: DeviceSpec) -> DeviceSet:
    """Returns the device set for a count or device names, splitting the CPU if needed.

    A count ``n`` takes ``GPU:0`` .. ``GPU:{n-1}`` when there are at least ``n`` GPUs, and
    otherwise ``n`` logical CPU devices.

    Args:
        spec: A count, names (``"CPU:0,CPU:1"`` or a sequence), or a :class:`DeviceSet`.

    Returns:
        The :class:`DeviceSet`.

    Raises:
        DeviceError: If the count is not positive or too large, a name is malformed,
            repeated or names a device that does not exist, or the CPU can no longer be split.
    """
    if isinstance(spec, DeviceSet):
        return spec
    if isinstance(spec, str):
        spec = parse(spec)
    if isinstance(spec, bool) or not isinstance(spec, (int, Sequence)):
        raise DeviceError("A device set is a positive count, or device names such as "
                          f"['CPU:0', 'CPU:1']. Received: {spec!r}.")
    if isinstance(spec, int):
        return _from_count(spec)
    return _from_names(spec)


def _from_count(count: int) -> DeviceSet:
    if count < 1 or count > MAX_LOGICAL_CPUS:
        raise DeviceError(f"The number of devices must be from 1 to {MAX_LOGICAL_CPUS}. "
                          f"Received: {count}.")
    gpus = gpu_count()
    if gpus >= count:
        return DeviceSet(tuple(f"GPU:{i}" for i in range(count)))
    if gpus:  # Said: a GPU job that meant its GPUs would otherwise train on the CPU unawares.
        logging.warning("%d devices asked and this process sees %d GPU(s): training on %d "
                        "logical CPU devices instead. Ask for %d devices to train on the GPUs.",
                        count, gpus, count, gpus)
    ensure_logical_cpus(count)
    return DeviceSet(tuple(f"CPU:{i}" for i in range(count)))


def _from_names(names: Sequence[str]) -> DeviceSet:
    canonical = []
    for name in names:
        match = _NAME_RE.match(str(name).strip())
        if not match:
            raise DeviceError(f"Device names look like CPU:0 or GPU:1. Received: {name!r}.")
        canonical.append(f"{match['type'].upper()}:{int(match['index'])}")
    if len(set(canonical)) != len(canonical):
        raise DeviceError(f"A device set cannot repeat a device. Received: {list(names)}.")
    gpu_indices = [int(n.split(":")[1]) for n in canonical if n.startswith("GPU")]
    if gpu_indices and max(gpu_indices) >= gpu_count():
        raise DeviceError(f"No such GPU: {list(names)} asks for GPU:{max(gpu_indices)}, but "
                          f"this machine has {_describe_available()}.")
    cpu_indices = [int(n.split(":")[1]) for n in canonical if n.startswith("CPU")]
    if cpu_indices:
        if max(cpu_indices) >= MAX_LOGICAL_CPUS:
            raise DeviceError(f"CPU device indices go from 0 to {MAX_LOGICAL_CPUS - 1}. "
                              f"Received: {list(names)}.")
        ensure_logical_cpus(max(cpu_indices) + 1)
    return DeviceSet(tuple(canonical))
