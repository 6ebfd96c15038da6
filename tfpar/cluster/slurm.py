"""SLURM jobs: the cluster from the variables ``srun`` sets for each task, on CPU-only and GPU
nodes alike.

TensorFlow's ``SlurmClusterResolver`` reads the task layout from SLURM's variables, but on its
own it fails on the nodes most users have:

- without ``CUDA_VISIBLE_DEVICES`` it counts GPUs by running ``nvidia-smi``, which a CPU-only
  node does not have (``FileNotFoundError``);
- with no GPUs its allocation loop steps by zero GPUs per task (``ValueError``), or lists no
  task at all;
- every job starts its ports at 8888, so two jobs sharing a node take each other's ports.

:func:`resolver` keeps TensorFlow's resolver (its host list and task layout, and its GPU
allocation where each task gets GPUs of its own) and gives it what it cannot find itself: the
node's GPU count (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi`` where it is installed and
answers, else the driver's list in ``/proc/driver/nvidia/gpus``, else none), one slot per task
where tasks get no GPUs of their own, and a first port derived from the job and step ids.
:func:`pin_gpus` gives a task its share before CUDA starts, with or without
``SLURM_LOCALID``. No TensorFlow at import.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from absl import logging

from tfpar import worker_contract
from tfpar.cluster import gpus as gpus_lib
from tfpar.errors import ClusterError

if TYPE_CHECKING:
    import tensorflow as tf

STEP_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
                  "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
""": What ``srun`` sets for each task and the cluster is made of."""
PORT_LOW = 15000
"""The ports jobs are spread over: a block of PORT_BLOCK ports per job (and step), one per task on
a node, from PORT_LOW.
"""
PORT_HIGH = 65000
"""The end of the port range tfpar's Slurm jobs take their ports from."""
PORT_BLOCK = 64
"""The ports one Slurm job step takes, from a block chosen by job and step id."""


def check_environment(environ: Mapping[str, str]) -> None:
    """Raises unless ``environ`` holds what ``srun`` sets for each task of a step.

    Raises:
        ClusterError: Naming the missing or malformed variables.
    """
    missing = [name for name in STEP_VARIABLES if not environ.get(name)]
    if missing:
        raise ClusterError(f"cluster source 'slurm' needs the variables srun sets for each task; "
                           f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                           "set. Start every worker with srun (in an sbatch script: srun "
                           "tfpar-train ...).")
    for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        if not environ[name].isdigit():
            raise ClusterError(f"{name} must be a whole number. Received: {environ[name]!r}.")


def tasks_per_node(text: str) -> list[int]:
    """Expands SLURM's ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``: 2, 2, 2, 1).

    Raises:
        ClusterError: If ``text`` is not of that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ClusterError("SLURM_STEP_TASKS_PER_NODE lists tasks per node as '2(x3),1'. "
                               f"Received: {text!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def reserved_ports(text: str) -> list[int]:
    """Expands ``SLURM_STEP_RESV_PORTS`` (``"12000-12003"`` or ``"12000,12002-12003"``).

    Raises:
        ClusterError: If ``text`` is not of that form.
    """
    ports: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ClusterError("SLURM_STEP_RESV_PORTS lists ports as '12000-12003' or "
                               f"'12000,12002'. Received: {text!r}.")
        low = int(match.group(1))
        ports += list(range(low, int(match.group(2) or low) + 1))
    return ports


def port_base(environ: Mapping[str, str], tasks_on_a_node: int) -> int:
    """The first port of this step's tasks on each node (the same on every task of the step).

    Where ``srun`` reserved ports for the step (``srun --resv-ports``, on clusters whose
    ``MpiParams`` has a ``ports=`` range; ``SLURM_STEP_RESV_PORTS``), the first of them: Slurm
    gives no two running steps the same ports. Otherwise a block derived from the job and step
    ids, from :data:`PORT_LOW`: jobs sharing a node get different blocks unless their ids are a
    multiple of the block count apart (781 for blocks of 64); then the task whose port the
    other job holds stops with exit 75, and the job's next ``srun`` (a new step) takes a block
    the other's steps do not (the sbatch recipe reruns its step on 75).

    Args:
        environ: The task's environment (``SLURM_JOB_ID``, optionally ``SLURM_STEP_ID`` and
            ``SLURM_STEP_RESV_PORTS``).
        tasks_on_a_node: The most tasks of this step on one node.

    Raises:
        ClusterError: If the reserved ports are fewer than the tasks on a node, or not
            consecutive from the first.
    """
    if environ.get("SLURM_STEP_RESV_PORTS"):
        ports = reserved_ports(environ["SLURM_STEP_RESV_PORTS"])
        if ports[:tasks_on_a_node] != list(range(ports[0], ports[0] + tasks_on_a_node)):
            raise ClusterError(
                f"srun reserved the ports {environ['SLURM_STEP_RESV_PORTS']} for this step; "
                f"its {tasks_on_a_node} tasks on a node need as many consecutive ports. Reserve "
                "more (srun --resv-ports=N) or leave the reservation out.")
        return ports[0]
    block = max(PORT_BLOCK, tasks_on_a_node)
    blocks = (PORT_HIGH - PORT_LOW) // block
    job, step = int(environ["SLURM_JOB_ID"]), environ.get("SLURM_STEP_ID", "0")
    # Each later step moves by a stride that differs between jobs whose first blocks are the
    # same (their ids differ by a multiple of `blocks`, so their quotients differ): a job whose
    # step met another's ports meets them no more at its next step.
    stride = 1 + job // blocks
    return PORT_LOW + ((job + (int(step) if step.isdigit() else 0) * stride) % blocks) * block


def expand_hostlist(text: str) -> list[str]:
    """Expands SLURM's host list (``"n[1-2],m5,o[03-04,6]"``: n1, n2, m5, o03, o04, o6), in
    order, as TensorFlow's ``SlurmClusterResolver`` does.

    Raises:
        ClusterError: If ``text`` is not of that form.
    """
    hosts: list[str] = []
    part_form = r"[^,\[\]]*(?:\[[^\[\]]+\])?"
    if not re.fullmatch(rf"{part_form}(?:,{part_form})*", text):  # "n[1-2]-ib": refused,
        raise ClusterError(f"SLURM_STEP_NODELIST lists hosts as 'n[1-2],m5'. Received: "
                           f"{text!r}.")  # as TensorFlow's resolver does.
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\])?", text):
        if not part:
            continue
        match = re.fullmatch(r"([^,\[\]]*)(?:\[([^\]]+)\])?", part)
        if match is None or (not match.group(1) and not match.group(2)):
            raise ClusterError(f"SLURM_STEP_NODELIST lists hosts as 'n[1-2],m5'. Received: "
                               f"{text!r}.")
        if match.group(2) is None:
            hosts.append(match.group(1))
            continue
        for span in match.group(2).split(","):
            low, _, high = span.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ClusterError(f"SLURM_STEP_NODELIST lists hosts as 'n[1-2],m5'. "
                                   f"Received: {text!r}.")
            hosts += [match.group(1) + str(i).zfill(len(low))
                      for i in range(int(low), int(high or low) + 1)]
    return hosts


def local_id(environ: Mapping[str, str]) -> int:
    """This task's index among the step's tasks on its node: ``SLURM_LOCALID``, else where
    TensorFlow's ``SlurmClusterResolver`` places ``SLURM_PROCID`` (the nodes of
    ``SLURM_STEP_NODELIST`` sorted by name, each node's tasks in rank order), which is the
    GPU share the resolver would give it.

    Raises:
        ClusterError: If the variables are missing or malformed, or the rank is outside the
            step's tasks.
        ValueError: If ``SLURM_LOCALID`` or ``SLURM_PROCID`` is not a number.
    """
    if environ.get("SLURM_LOCALID", "").strip():  # Set but empty: as if missing.
        return int(environ["SLURM_LOCALID"])
    rank = int(environ["SLURM_PROCID"])
    hosts = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    counts = dict(zip(hosts, tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])))
    first = 0
    for _, count in sorted(counts.items()):
        if rank < first + count:
            return rank - first
        first += count
    raise ClusterError(f"SLURM_PROCID={rank} is not one of the step's {first} tasks "
                       f"(SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r}).")


def gpus_on_node(environ: Mapping[str, str],
                 which: Callable[[str], str | None] = shutil.which) -> int:
    """How many GPUs this node shows the task: ``CUDA_VISIBLE_DEVICES`` when set, else what
    ``nvidia-smi --list-gpus`` lists where it is installed and answers, else what the driver
    lists in ``/proc/driver/nvidia/gpus``, else none."""
    return len(gpus_lib.visible_gpus(environ, which))


def pin_gpus(environ: MutableMapping[str, str] | None = None,
             which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Gives this task its own share of the node's GPUs through ``CUDA_VISIBLE_DEVICES``,
    before anything starts CUDA (which reads it once, at its start), where Slurm gave the task
    none of its own: the node's GPUs (:func:`tfpar.cluster.gpus.visible_gpus`: ``nvidia-smi``,
    else the driver's list) divided evenly among the step's tasks on the node, by the task's
    local id (:func:`local_id`, also without ``SLURM_LOCALID``), as TensorFlow's resolver would
    allocate them.

    Args:
        environ: The task's environment (default: this process's), changed in place.
        which: Finds ``nvidia-smi``.

    Returns:
        What it set, or ``None`` where it set nothing: not a Slurm task, GPUs already given,
        or fewer GPUs on the node than tasks.
    """
    environ = os.environ if environ is None else environ
    needed = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_STEP_NODELIST")
    if worker_contract.VISIBLE_GPUS_ENV in environ or not all(name in environ for name in needed):
        return None
    try:
        per_node = max(tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"]))
        local = local_id(environ)
    except (ClusterError, ValueError):
        return None  # Said where the cluster is resolved.
    node, note = gpus_lib.gpu_listing(environ, which)
    if note:
        logging.warning("%s", note)
    each = len(node) // per_node
    if each == 0 or not 0 <= local < per_node:
        return None
    share = ",".join(node[local * each:(local + 1) * each])
    environ[worker_contract.VISIBLE_GPUS_ENV] = share
    return share


def given_gpus(environ: Mapping[str, str]) -> int:
    """How many GPUs a Slurm task was given (``CUDA_VISIBLE_DEVICES``), 0 outside Slurm."""
    if "SLURM_PROCID" not in environ or worker_contract.VISIBLE_GPUS_ENV not in environ:
        return 0
    return len(gpus_lib.visible_gpus(environ, lambda _: None))


def resolver(environ: Mapping[str, str] | None = None
             ) -> tf.distribute.cluster_resolver.SlurmClusterResolver:
    """TensorFlow's ``SlurmClusterResolver`` for this task, on CPU-only and GPU nodes.

    Where the node has at least one GPU per task of the step on it, TensorFlow allocates them
    (each task sees its own through ``CUDA_VISIBLE_DEVICES``). Otherwise every task keeps the
    devices it sees: none (CPU-only nodes), or those SLURM already gave it.

    Args:
        environ: The task's environment (default: this process's).

    Returns:
        The resolver.

    Raises:
        ClusterError: If a variable ``srun`` sets is missing or malformed.
    """
    import tensorflow as tf

    environ = os.environ if environ is None else environ
    check_environment(environ)
    per_node = max(tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"]))
    base = port_base(environ, per_node)
    if worker_contract.VISIBLE_GPUS_ENV in environ:
        # Slurm (--gpus-per-task, --gres) or pin_gpus gave this task its GPUs: kept as they
        # are. TensorFlow's allocation would count them as the node's and rewrite them to
        # indices of other tasks' GPUs (task 1 given 2,3 would get 1).
        return tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=base, gpus_per_node=per_node, gpus_per_task=1, auto_set_gpu=False)
    gpus = gpus_on_node(environ)
    if gpus >= per_node:
        return tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=base, gpus_per_node=gpus, gpus_per_task=gpus // per_node)
    # One slot per task (the resolver hands out ports only alongside GPU slots), and nothing
    # written to CUDA_VISIBLE_DEVICES.
    return tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=base, gpus_per_node=per_node, gpus_per_task=1, auto_set_gpu=False)
