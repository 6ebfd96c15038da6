"""How a process's CPU threads are laid out over its logical CPU devices, and the layout this
machine was tuned to: the one home of tfpar's thread choices (TensorFlow is imported only by
the functions that hand a layout to it).

A :class:`ThreadLayout` is the intra-op threads of each logical device, whether each device
has a pool of its own (``TF_OVERRIDE_GLOBAL_THREADPOOL``) and the inter-op threads that drive
the replicas. The best layout differs by CPU kind and model (a default that wins on one kind
can lose on another), so tfpar does not hard-code one:
``tfpar-benchmark --tune`` times :func:`candidates` for the user's model in paired
rounds on the user's machine and stores the winner under :func:`machine_key` (CPU model, core
count, TensorFlow version, oneDNN's ISA cap). When :func:`tfpar.devices.ensure_logical_cpus`
splits the CPU, :func:`for_split` picks the stored layout for that many devices (:func:`default`
where none is stored) and :func:`use_pools` and :func:`apply` give it to TensorFlow; the
benchmark's default threads are :func:`default`'s too. ``tfpar-env`` shows which.

Worker processes of a multi-worker job that share a host are laid out the same way, one device
each: :func:`worker_candidates` (TensorFlow's own threads first, the default), stored under
:func:`workers_key` and applied by the multi-worker strategies (:func:`chosen_for_workers`).

The store is a JSON file, ``$TFPAR_TUNING_FILE`` or ``~/.cache/tfpar/thread_layouts.json``
(``$XDG_CACHE_HOME`` honoured); a layout is only ever used on the machine kind it was
measured on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from tfpar import atomic_io
from tfpar.host import machine

TUNING_FILE_ENV = "TFPAR_TUNING_FILE"
"""The environment variable naming the file of tuned thread layouts (one per machine kind)."""
PER_DEVICE_THREAD_POOLS_ENV = "TF_OVERRIDE_GLOBAL_THREADPOOL"
""": TensorFlow's switch for a pool of intra-op threads per logical CPU device (read when :
TensorFlow initialises).
"""


@dataclasses.dataclass(frozen=True)
class ThreadLayout:
    """Threads of a process split into logical CPU devices.

    Attributes:
        threads_per_device: Intra-op threads of each device (of the shared pool without
            per-device pools).
        per_device_pools: Each device has a pool of its own; else they share one.
        inter_op_threads: Inter-op threads (``None``: one per device).
    """

    threads_per_device: int
    per_device_pools: bool = True
    inter_op_threads: int | None = None

    def inter_op(self, num_devices: int) -> int:
        """The inter-op threads for ``num_devices`` devices."""
        return self.inter_op_threads or num_devices

    def describe(self, num_devices: int) -> str:
        """One line, e.g. ``1 intra-op thread per device, a pool each, 2 inter-op``."""
        pools = "a pool each" if self.per_device_pools else "one shared pool"
        return (f"{self.threads_per_device} intra-op thread(s) per device, {pools}, "
                f"{self.inter_op(num_devices)} inter-op")


def default(num_devices: int, cores: int | None = None) -> ThreadLayout:
    """The layout used where none is stored: the cores shared evenly, a pool per device, an
    inter-op thread per device (a logical device is then like one GPU)."""
    cores = cores or os.cpu_count() or 1
    return ThreadLayout(max(1, cores // num_devices))


def for_virtual_replicas(num_devices: int, cores: int | None = None) -> ThreadLayout:
    """The layout world-size invariance (``virtual_replicas``) trains with on the CPU: one
    intra-op thread per device, as a kernel's sums can depend on its threads, and an inter-op
    thread per core (at least one per device), on which each device runs its replica's shards
    side by side, so that the mode still uses every core on fewer devices than cores."""
    cores = cores or os.cpu_count() or 1
    return ThreadLayout(1, inter_op_threads=max(num_devices, cores))


def for_split(num_devices: int) -> ThreadLayout | None:
    """The layout a CPU split now into ``num_devices`` devices gets: the one tuned on this
    machine kind, else :func:`default`; ``None`` where the user set threads with
    ``tf.config.threading`` (kept; fewer inter-op threads than devices are warned about)."""
    import tensorflow as tf
    from absl import logging

    user_inter_op = tf.config.threading.get_inter_op_parallelism_threads()
    if tf.config.threading.get_intra_op_parallelism_threads() == 0 and user_inter_op == 0:
        return chosen(num_devices)[0]
    if 0 < user_inter_op < num_devices:
        # Fewer inter-op threads than devices: the replicas' steps no longer overlap.
        logging.warning(
            "%d inter-op thread(s) set with tf.config.threading for %d logical CPU devices: "
            "the replicas take turns, so training runs at about one device's speed. Set at "
            "least %d, or leave the threads unset for tfpar to choose.",
            user_inter_op, num_devices, num_devices)
    return None


def use_pools(layout: ThreadLayout | None, *, replace: bool = False) -> None:
    """Sets :data:`PER_DEVICE_THREAD_POOLS_ENV` for a CPU split into several devices (before
    TensorFlow initialises): a pool per device unless ``layout`` shares one; a value the user
    set is kept unless ``replace``."""
    value = "1" if layout is None or layout.per_device_pools else "0"
    if replace:
        os.environ[PER_DEVICE_THREAD_POOLS_ENV] = value
    else:
        os.environ.setdefault(PER_DEVICE_THREAD_POOLS_ENV, value)


def apply(layout: ThreadLayout, num_devices: int, *, least_inter_op: int = 0) -> None:
    """Gives TensorFlow ``layout``'s intra-op and inter-op threads for ``num_devices`` devices
    (at least ``least_inter_op`` inter-op threads).

    Raises:
        RuntimeError: If TensorFlow has initialised with other threads.
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(layout.threads_per_device)
    tf.config.threading.set_inter_op_parallelism_threads(
        max(layout.inter_op(num_devices), least_inter_op))


def candidates(num_devices: int, cores: int | None = None) -> list[ThreadLayout]:
    """The layouts ``--tune`` times, :func:`default` first: the same threads in one shared
    pool, every core in each device's pool, and twice the inter-op threads."""
    cores = cores or os.cpu_count() or 1
    base = default(num_devices, cores)
    found = [base, dataclasses.replace(base, per_device_pools=False),
             dataclasses.replace(base, threads_per_device=cores),
             dataclasses.replace(base, inter_op_threads=2 * num_devices)]
    return list(dict.fromkeys(found))  # Without repeats (one core: the same threads).


def worker_candidates(workers: int, cores: int | None = None) -> list[ThreadLayout]:
    """The layouts ``--tune`` times for ``workers`` worker processes of one device each on one
    host, the default first: TensorFlow's own (every core for intra-op and for inter-op work in
    each worker), then the cores shared out between the workers with one and with two
    inter-op threads."""
    cores = cores or os.cpu_count() or 1
    share = max(1, cores // workers)
    found = [ThreadLayout(cores, inter_op_threads=cores), ThreadLayout(share, inter_op_threads=1),
             ThreadLayout(share, inter_op_threads=2)]
    return list(dict.fromkeys(found))


def workers_key(workers: int) -> str:
    """The store's key of a layout for ``workers`` worker processes on one host."""
    return f"{workers} workers"


def machine_key() -> str:
    """What a tuned layout is only valid for: CPU model (name, family/model numbers), vector
    extension and oneDNN's cap, native bfloat16, core count, TensorFlow version."""
    cpu = machine.cpu()
    return (f"{cpu['model']} ({cpu['family_model']}) | {cpu['vector_extension']} (oneDNN cap "
            f"{cpu['onednn_max_cpu_isa']}, native bfloat16 {cpu['native_bfloat16']}) | "
            f"{os.cpu_count() or 1} cores | "
            f"tensorflow {machine.package_version('tensorflow')}")


def tuning_file() -> str:
    """Where tuned layouts are stored."""
    if os.environ.get(TUNING_FILE_ENV):
        return os.environ[TUNING_FILE_ENV]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tfpar", "thread_layouts.json")


def _read() -> dict[str, Any]:
    try:
        with open(tuning_file(), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # None stored yet, or unreadable: the default applies.


def stored(num_devices: int | str) -> dict[str, Any] | None:
    """The record tuned on this machine kind for ``num_devices`` devices (or a
    :func:`workers_key`): ``layout`` (a :class:`ThreadLayout`), ``model``, ``speedup`` over the
    default, ``rounds``, and, if timed, ``steps_per_execution`` (steps per compiled call ->
    speedup) and ``one_process_per_device`` (multi-worker entry -> speedup); or ``None``."""
    record = _read().get(machine_key(), {}).get(str(num_devices))
    if not isinstance(record, dict):
        return None
    try:
        layout = ThreadLayout(**record["layout"])
    except (KeyError, TypeError):
        return None
    return {**record, "layout": layout}


def chosen(num_devices: int) -> tuple[ThreadLayout, str]:
    """The layout for ``num_devices`` devices on this machine and where it comes from
    (``"tuned ..."`` or ``"default"``)."""
    record = stored(num_devices)
    if record is None:
        return default(num_devices), "default (not tuned on this machine kind)"
    return record["layout"], _tuned_source(record)


def chosen_for_workers(workers: int) -> tuple[ThreadLayout | None, str]:
    """The layout tuned for ``workers`` worker processes on one host of this machine kind
    (``None``: TensorFlow's own threads, the default) and where it comes from."""
    record = stored(workers_key(workers))
    if record is None:
        return None, "TensorFlow's own threads (not tuned on this machine kind)"
    return record["layout"], _tuned_source(record)


def _tuned_source(record: dict[str, Any]) -> str:
    also = "".join(f"; {steps} steps per compiled call {ratio:.2f}x"
                   for steps, ratio in record.get("steps_per_execution", {}).items())
    also += "".join(f"; one process per device ({name}) {ratio:.2f}x"
                    for name, ratio in record.get("one_process_per_device", {}).items())
    return (f"tuned with {record.get('model', '?')}, "
            f"{record.get('speedup', 1.0):.2f}x the default{also}")


def store(num_devices: int | str, layout: ThreadLayout, **evidence: Any) -> str:
    """Stores ``layout`` for ``num_devices`` devices (or a :func:`workers_key`) on this machine
    kind, with what showed it (model, speedup, rounds); the file is replaced whole. Returns the
    file's path."""
    data = _read()
    data.setdefault(machine_key(), {})[str(num_devices)] = {
        "layout": dataclasses.asdict(layout), **evidence}
    path = tuning_file()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_io.write_json(path, data)
    return path
