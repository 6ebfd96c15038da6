"""Which GPUs a host shows, and each local worker's own share of them.

A launcher that starts N workers on a host with G GPUs gives each its own G // N of them through
``CUDA_VISIBLE_DEVICES``, as ``horovodrun`` and ``torchrun`` users pin one GPU per local rank:
CUDA, and so TensorFlow, then shows a worker only its share, numbered from 0 (TensorFlow's
``GPU:0`` is the first GPU of its share). Without it every worker would see every GPU and, with
one device each, all would train on the first. Shares follow the worker's slot (kept across
restarts of an elastic job), so a worker keeps its GPUs when others come and go. No TensorFlow
here: the launcher reads ``CUDA_VISIBLE_DEVICES`` (each GPU listed once), ``nvidia-smi`` or,
where ``nvidia-smi`` is not installed (a slim container) or fails (a driver that does not
answer; one line says so), the driver's own list of GPUs in ``/proc``.

MIG: a GPU split into MIG instances is listed as its instances' UUIDs (``MIG-...``), each a
worker's share of one: CUDA shows a process one MIG instance at most, so ``gpus_per_worker``
above 1 is refused there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

from tfpar import worker_contract
from tfpar.errors import ConfigError

DRIVER_GPUS = "/proc/driver/nvidia/gpus"
"""Where NVIDIA's driver lists the host's GPUs, one folder each (read where nvidia-smi is
missing or fails)."""


def visible_gpus(environ: Mapping[str, str],
                 which: Callable[[str], str | None] = shutil.which,
                 driver_gpus: str | None = None) -> list[str]:
    """The GPUs this process may use, as CUDA names them: ``CUDA_VISIBLE_DEVICES``'s entries
    when it is set, else what ``nvidia-smi --list-gpus`` lists where it is installed and
    answers (a GPU's index, or its MIG instances' UUIDs), else one index per GPU the driver
    lists in ``driver_gpus`` (default :data:`DRIVER_GPUS`), else none (see
    :func:`gpu_listing`, which also says why where ``nvidia-smi`` failed).

    Raises:
        ConfigError: If ``CUDA_VISIBLE_DEVICES`` lists a GPU more than once.
    """
    return gpu_listing(environ, which, driver_gpus)[0]


def gpu_listing(environ: Mapping[str, str],
                which: Callable[[str], str | None] = shutil.which,
                driver_gpus: str | None = None) -> tuple[list[str], str | None]:
    """The GPUs this process may use (:func:`visible_gpus`), and a line where ``nvidia-smi``
    is installed but failed (a driver that does not answer, a version mismatch), saying that
    the driver's own list in ``driver_gpus`` was counted instead (``None`` otherwise).

    Args:
        environ: The process's environment (``CUDA_VISIBLE_DEVICES``).
        which: Finds ``nvidia-smi``.
        driver_gpus: Where the driver lists its GPUs (default :data:`DRIVER_GPUS`).

    Returns:
        The GPUs, as CUDA names them, and the line (or ``None``).

    Raises:
        ConfigError: If ``CUDA_VISIBLE_DEVICES`` lists a GPU more than once.
    """
    driver_gpus = DRIVER_GPUS if driver_gpus is None else driver_gpus
    visible = environ.get(worker_contract.VISIBLE_GPUS_ENV)
    if visible is not None:
        entries = [d.strip() for d in visible.split(",")]
        # CUDA stops at the first invalid entry ("-1" hides every GPU).
        shown: list[str] = []
        for entry in entries:
            if not entry or entry.startswith("-"):
                break
            # CUDA reads an index as a number: "00" is GPU 0 again.
            if _same_gpu(entry) in (_same_gpu(e) for e in shown):
                raise ConfigError(
                    f"{worker_contract.VISIBLE_GPUS_ENV} lists GPU {entry} more than once, so "
                    f"workers would share it. List each GPU once. Received: "
                    f"{worker_contract.VISIBLE_GPUS_ENV}={visible!r}.")
            shown.append(entry)
        return shown, None
    program = which("nvidia-smi")
    if program is None:  # A slim image without nvidia-smi: the driver still lists its GPUs.
        return _driver_gpus(driver_gpus), None
    try:
        done = subprocess.run([program, "--list-gpus"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        failure = "no answer within 30 s"
    except (OSError, subprocess.SubprocessError) as e:
        failure = getattr(e, "strerror", None) or str(e)
    else:
        if done.returncode == 0:
            return listed_gpus(done.stdout), None
        said = (done.stderr or done.stdout).strip().splitlines()
        failure = (f"exit status {done.returncode}" if done.returncode > 0 else
                   f"ended by signal {-done.returncode}, as by a notice or Ctrl-C to the "
                   "launcher's process group") + (f": {said[0].strip()}" if said else "")
    listed = _driver_gpus(driver_gpus)
    if listed:
        return listed, (f"nvidia-smi failed ({failure}); counting the GPUs the driver lists in "
                        f"{driver_gpus} instead: {len(listed)}.")
    return [], (f"nvidia-smi failed ({failure}), and the driver lists no GPU in {driver_gpus}: "
                "no GPU is given.")


def _same_gpu(entry: str) -> str:
    """A ``CUDA_VISIBLE_DEVICES`` entry as the GPU it names (an index without its leading
    zeros, else the UUID as given)."""
    return str(int(entry)) if entry.isdigit() else entry


def _driver_gpus(driver_gpus: str) -> list[str]:
    """One index per GPU the driver lists (one folder each), in CUDA's default order."""
    try:
        return [str(i) for i in range(len(os.listdir(driver_gpus)))]
    except OSError:
        return []


def listed_gpus(listing: str) -> list[str]:
    """The GPUs in ``nvidia-smi --list-gpus``'s output: each GPU's index, or, for a GPU split
    into MIG instances, the instances' UUIDs (the names CUDA takes for them)."""
    instances: list[list[str]] = []  # Per GPU, in order: its MIG instances' UUIDs.
    for line in listing.splitlines():
        if line.startswith("GPU "):
            instances.append([])
        elif instances and line.strip().startswith("MIG ") and "UUID: MIG-" in line:
            instances[-1].append(line.split("UUID: ", 1)[1].rstrip(") ").strip())
    return [name for index, uuids in enumerate(instances) for name in uuids or [str(index)]]


def shares(gpus: Sequence[str], num_slots: int,
           per_worker: int | None = None) -> tuple[dict[int, str], str | None]:
    """Each worker slot's share of ``gpus``, as a ``CUDA_VISIBLE_DEVICES`` value.

    Args:
        gpus: The host's GPUs (:func:`visible_gpus`).
        num_slots: The most workers the job runs on this host.
        per_worker: GPUs per worker (``None``: as many as divide evenly; 0: none, the workers
            run on the CPU).

    Returns:
        The value per slot (empty where no GPU is to be given: a CPU host, or ``per_worker``
        0, whose workers get ``""``), and a line for what is left idle (``None`` when all are
        used).

    Raises:
        ConfigError: If the workers need more GPUs than the host shows.
    """
    if per_worker is not None and (isinstance(per_worker, bool) or not isinstance(
            per_worker, int) or per_worker < 0):
        raise ConfigError(f"{{argument}} must be an integer >= 0. Received: {per_worker!r}.",
                          argument="gpus_per_worker")
    if not gpus and not per_worker:
        return {}, None
    if per_worker == 0:
        return {slot: "" for slot in range(num_slots)}, None
    each = per_worker if per_worker is not None else len(gpus) // num_slots
    if each > 1 and any(gpu.startswith("MIG-") for gpu in gpus):
        raise ConfigError(f"These GPUs are MIG instances, and CUDA shows a process one MIG "
                          f"instance at most; {num_slots} workers would get {each} each. Give "
                          f"each worker one ({{argument}}=1), or start {len(gpus)} workers.",
                          argument="gpus_per_worker")
    if each == 0 or each * num_slots > len(gpus):
        raise ConfigError(
            f"{num_slots} workers of {each or 1} GPU each need {max(each, 1) * num_slots} GPUs; "
            f"this host shows {len(gpus)} ({worker_contract.VISIBLE_GPUS_ENV}, nvidia-smi or the "
            f"driver's list). Run fewer workers, or set {{argument}}=0 to run them on the CPU.",
            argument="gpus_per_worker")
    given = {slot: ",".join(gpus[slot * each:(slot + 1) * each]) for slot in range(num_slots)}
    idle = gpus[each * num_slots:]
    note = (f"launcher: {len(gpus)} GPUs among {num_slots} workers: {each} each; GPU "
            f"{', '.join(idle)} left idle (set gpus_per_worker to choose)." if idle else None)
    return given, note
