"""A local launcher: N worker processes of one command on loopback, with TF_CONFIG each.

It is an agent of three parts: a :class:`~tfpar.cluster.worker_group.WorkerGroup` runs one
round of workers and says how it ended; the pure
:func:`~tfpar.cluster.restart_policy.decide` turns that, the progress saved and the job's
bookkeeping into the next step (exit, restart, shrink, grow) and its line; :func:`launch` is the
short loop between them. What launcher and workers agree on (environment, statuses, the state
layout, the record a worker leaves as it stops) is :mod:`.protocol`; the launcher's signals go
through :mod:`.signal_router`, from before the first worker starts until the last exited.

It picks free ports, gives each worker its ``TF_CONFIG``, prefixes every output line with the
worker's rank, and supervises: if a worker fails or is killed, the others are stopped and the
launcher reports which worker failed; Ctrl-C or SIGTERM stops every worker. Workers run in
their own process groups, so nothing they start outlives the launcher; and a launcher that is
killed outright (``kill -9``, the out-of-memory killer) takes its workers with it (Linux's
parent-death signal), so a launcher run again never shares a model folder with orphans.

With ``max_restarts`` it restarts the whole group after a failure, as ``torchrun
--max-restarts`` does: the failed worker's peers are stopped and every worker starts again with
fresh ports, resuming from the last state in the folder the job's chief declared
(:class:`~tfpar.worker_contract.WorkerSpec`; the launcher never reads its command's flags).

With ``min_workers`` below ``num_workers`` the job is elastic (:mod:`.elastic`): a worker that
fails more often than ``max_restarts`` allows is lost and the job goes on with the others, down
to ``min_workers``, from the last saved state at the same global batch (tfpar's programs read
the global batch from their flags, whatever the number of workers); lost workers are tried
again at the next restart or epoch boundary. One line says each change and why.

Preemption notices (:mod:`.preemption`): a worker that exits with the preempted status stopped
at the step the whole job agreed on, after saving, so its peers are left to finish saving, and
the job is restarted without counting a failure (while each preemption saved progress). A
SIGTERM (or SIGUSR1) to the launcher itself is passed to every worker as a notice; the launcher
then exits with the preempted status once they have saved.

By default the workers run on a private loopback network (:mod:`.private_network`), since
TensorFlow's gRPC server listens on every interface without authentication; ``network="host"``
runs them on the machine's network instead (then their ports must be firewalled), and a port
taken by another program before a worker binds it makes the launcher start over with new ports.

Why one module of this length: it is the loop and its checks; the flag readers of 0.3
(``flag_of``, ``model_dir_of``, ``run_folders``, deprecated) keep it past 400 lines until 0.5.0
removes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import shutil
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import TextIO

from tfpar import worker_contract
from tfpar.cluster import elastic
from tfpar.cluster import gpus as gpus_lib
from tfpar.cluster import preemption
from tfpar.cluster import signal_router
from tfpar.cluster import worker_environment
from tfpar.cluster.restart_policy import Action
from tfpar.cluster.restart_policy import Decision
from tfpar.cluster.restart_policy import JobState
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import Progress
from tfpar.cluster.restart_policy import RoundResult
from tfpar.cluster.restart_policy import decide
from tfpar.cluster.restart_policy import growth_due
from tfpar.cluster.worker_group import NOTICES
from tfpar.cluster.worker_group import SignalTaken
from tfpar.cluster.worker_group import WorkerGroup
from tfpar.cluster.worker_group import check_signals
from tfpar.cluster.worker_group import free_ports
from tfpar.cluster.worker_group import tf_configs
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus

__all__ = ["INTERRUPTED_STATUS", "NETWORKS", "flag_of", "free_ports", "launch", "model_dir_of",
           "run_folders", "tf_configs"]

PREEMPTION_MARGIN_SECONDS = 10.0
"""After a preemption (a worker stopped for a notice, or a notice to the launcher), how long the
other workers may take to save and exit, beyond their own grace budget, before they are killed.
"""
NETWORKS = ("private", "host")
"""Where the launcher's workers run: a private loopback network, or the machine's."""
INTERRUPTED_STATUS = ExitStatus.INTERRUPTED
"""The launcher's status after Ctrl-C."""


def flag_of(command: Sequence[str], name: str) -> str | None:
    """The value of ``--name`` in a command line, or ``None``, as absl reads it.

    Deprecated: the launcher reads what its workers declare
    (:class:`tfpar.worker_contract.WorkerSpec`), never their flags; removed in 0.5.0.
    """
    warnings.warn("tfpar.cluster.launcher.flag_of is deprecated and will be removed in tfpar "
                  "0.5.0: a worker declares what the launcher needs "
                  "(tfpar.worker_contract.declare, a WorkerSpec).", DeprecationWarning,
                  stacklevel=2)
    return _flag_of(command, name)


def _flag_of(command: Sequence[str], name: str) -> str | None:
    """``--name=V``, ``--name V`` or with one dash (``-name=V``), the last one given winning
    (a wrapper's ``--``, as in ``uv run -- python t.py``, is looked past)."""
    value = None
    args = iter(_with_flagfiles(command))
    for arg in args:
        for dashes in ("--", "-"):
            if arg.startswith(f"{dashes}{name}="):
                value = arg.split("=", 1)[1] or None
                break
            if arg == f"{dashes}{name}":
                value = next(args, None)
                break
    return value


def _with_flagfiles(command: Sequence[str], depth: int = 0) -> list[str]:
    """``command`` with each ``--flagfile=F`` replaced by the flags F holds, in place, as absl
    reads them (one a line; ``#`` and ``//`` lines are comments; nested up to a few deep);
    a file that cannot be read is left to the program to refuse."""
    expanded: list[str] = []
    args = iter(command)
    for arg in args:
        path = None
        for dashes in ("--", "-"):
            if arg.startswith(f"{dashes}flagfile="):
                path = arg.split("=", 1)[1]
                break
            if arg == f"{dashes}flagfile":
                path = next(args, None)
                break
        if path is None:
            expanded.append(arg)
            continue
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError):
            continue
        if depth < 4:
            expanded += _with_flagfiles([line for line in lines if line.startswith("-")],
                                        depth + 1)
    return expanded




def model_dir_of(command: Sequence[str]) -> str | None:
    """The ``--model_dir`` a tfpar training command carries, or ``None``.

    Deprecated: the launcher reads the folder the command's chief declares
    (:class:`tfpar.worker_contract.WorkerSpec`), never its flags; removed in 0.5.0.
    """
    warnings.warn("tfpar.cluster.launcher.model_dir_of is deprecated and will be removed in "
                  "tfpar 0.5.0: a worker declares its folder (tfpar.worker_contract.declare, "
                  "a WorkerSpec), which the launcher reads.", DeprecationWarning, stacklevel=2)
    return _flag_of(command, "model_dir")


def run_folders(command: Sequence[str]) -> list[str]:
    """The folders under ``--model_dir`` where a tfpar training command keeps its state, as
    worked out from its flags with ``tfpar-train``'s defaults.

    Deprecated: the launcher reads the folder the command's chief declares
    (:class:`tfpar.worker_contract.WorkerSpec`) instead; removed in 0.5.0.
    """
    warnings.warn("tfpar.cluster.launcher.run_folders is deprecated and will be removed in "
                  "tfpar 0.5.0: a worker declares its folder (tfpar.worker_contract.declare, "
                  "a WorkerSpec), which the launcher reads.", DeprecationWarning, stacklevel=2)
    strategy = _flag_of(command, "strategy") or "mirrored"
    names = _flag_of(command, "devices")
    counts = ([len([n for n in names.split(",") if n.strip()])] if names
              else [int(n) for n in (_flag_of(command, "num_devices") or "1").split(",")
                    if n.strip().isdigit()])
    return ["", *(worker_contract.run_folder_name(strategy, n) for n in counts)]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def launch(command: Sequence[str], num_workers: int, host: str = "127.0.0.1",
           out: TextIO | None = None, all_output: bool = False,
           network: str = "private", max_restarts: int = 0,
           resumes_itself: bool = False, min_workers: int | None = None,
           gpus: Sequence[str] | None = None, gpus_per_worker: int | None = None) -> int:
    """Runs ``command`` as ``num_workers`` workers and supervises them.

    Args:
        command: The program and its arguments, e.g. ``["tfpar-train", ...]``.
        num_workers: Number of worker processes (the most, for an elastic job).
        host: The workers' address (loopback unless told otherwise).
        out: Where prefixed output goes (standard output by default).
        all_output: Every worker prints progress and reports, not only the chief.
        network: ``"private"``: the workers run on a loopback network of their own, which
            nothing outside the job can reach (nor can they reach the network; Linux only).
            ``"host"``: on this machine's network, where TensorFlow's servers listen on every
            interface (firewall their ports).
        max_restarts: How many times the whole group is started again after a worker fails
            (a non-zero exit other than 2, bad input: a crash, a kill, a worker stopped by a
            signal of its own, a peer lost; not Ctrl-C to the launcher). Each restart resumes
            from the last state saved in the folder the job's chief declared
            (:func:`~tfpar.worker_contract.declare`: ``tfpar-train --model_dir``, tfpar's
            ``EpochCheckpoint`` and Keras's ``BackupAndRestore`` declare theirs); a command
            whose chief declared none starts again from scratch, and the line says so. The
            workers are told restarts follow (:data:`~tfpar.worker_contract.RESTARTS_ENV`):
            ``tfpar-train`` without ``--model_dir`` refuses to start, exit 2. A job preempted
            after saving progress (its workers exited with the preempted status) is restarted
            too, without counting a failure. For an elastic job, the restarts at each number of
            workers.
        resumes_itself: The command resumes by itself from a state whose folder its chief does
            not declare (a saver of its own): a restart's line says so instead of "from
            scratch".
        min_workers: The fewest workers an elastic job goes on with (``None``: as many as
            ``num_workers``, not elastic). When a worker fails once more than ``max_restarts``
            allows, it is lost and the others go on from the last saved state, while at least
            ``min_workers`` remain; lost workers are tried again at the next restart, or at an
            epoch boundary (after 1 epoch, then 2, 4, ... while they keep failing): the
            launcher sees the epochs in the position record of the folder the chief declares
            (:func:`~tfpar.worker_contract.declare`,
            :func:`~tfpar.worker_contract.commit_position`; tfpar's ``EpochCheckpoint`` and
            Keras's ``BackupAndRestore`` write both), without one only restarts grow the job.
            The worker for whom a peer said it stopped answering is the one blamed.
        gpus: The host's GPUs as CUDA names them (``None``: ``CUDA_VISIBLE_DEVICES``, else
            what ``nvidia-smi`` lists, else, where it is missing or fails (said in one line),
            what the driver lists in ``/proc/driver/nvidia/gpus``, else none). Each worker gets
            its own share through ``CUDA_VISIBLE_DEVICES``.
        gpus_per_worker: GPUs per worker (``None``: the host's GPUs divided evenly among
            ``num_workers``; 0: none, the workers run on the CPU).

    Returns:
        0 if every worker succeeded; else the failing worker's exit status (or 128 + signal);
        130 after Ctrl-C to the launcher; after a notice to the launcher (at any moment from
        its first import of tfpar to its end) the preempted status
        (:data:`tfpar.errors.ExitStatus.PREEMPTED`) once every worker saved (or finished),
        else the worst status a worker ended with
        (128 + 9 for one killed past the grace budget); the preempted status after a
        preemption it does not restart.

    Raises:
        ConfigError: If the command is empty or cannot be run, ``num_workers`` < 1,
            ``min_workers`` is not from 1 to ``num_workers``, ``max_restarts`` is not an integer
            >= 0, ``host`` is not an address of this machine (or not loopback on a private
            network), a private network cannot be made here, ``CUDA_VISIBLE_DEVICES`` lists a
            GPU twice, or the workers need more GPUs than the host shows. (A
            world-size-invariant job whose replicas do not divide its shards is refused by
            its workers, exit 2; the sizes an elastic one shrinks to are those its chief
            declares, :class:`~tfpar.worker_contract.WorkerSpec`.)
    """
    # Signals are the launcher's from here on: a notice while it looks for GPUs
    # (nvidia-smi can take seconds) is taken before the first round, as between two rounds.
    subscribed = signal_router.subscribe((signal.SIGINT, *NOTICES))
    # A launcher program's notices (watched from its first import of tfpar: one before here
    # ends it with the preempted status) are passed on to the workers from here.
    with contextlib.ExitStack() as stack:
        stack.enter_context(preemption.NOTICE.handed_over())
        if subscribed:  # Before the hand-over ends, as the handlers were set before it began.
            stack.callback(signal_router.unsubscribe)
        _check_launch(command, num_workers, min_workers, host, network, max_restarts)
        out = out or sys.stdout
        given = _gpu_shares(num_workers, gpus, gpus_per_worker, out)
        # Where each round's chief declares itself (folder, grace budget, replicas).
        records = tempfile.mkdtemp(prefix="tfpar-spec-")
        stack.callback(shutil.rmtree, records, True)
        slots = elastic.WorkerSlots(num_workers if min_workers is None else min_workers,
                                    num_workers)
        job = _Job(command, host, out, all_output, network, given, records,
                   restarts=bool(max_restarts or slots.elastic))
        state = JobState(slots, max_restarts, 0, resumes_itself,
                         program=signal_router.command_runs_program(command))
        while True:
            decision = job.round(state)
            if decision.line:
                out.write(f"{decision.line}\n")
                out.flush()
            if decision.action is Action.EXIT:
                return decision.status
            state = decision.state
    raise AssertionError("unreachable")  # For type checkers: the loop returns.


def _gpu_shares(num_workers: int, gpus: Sequence[str] | None, gpus_per_worker: int | None,
                out: TextIO) -> dict[int, str]:
    """Each slot's ``CUDA_VISIBLE_DEVICES`` (see :func:`launch`), with the lines that say how
    the host's GPUs were found and which are left idle."""
    if worker_environment.legacy_keras_asked():
        out.write(f"launcher: {worker_environment.LEGACY_KERAS_ENV} (Ray's TensorflowTrainer "
                  "sets it) is not passed to the workers: tf.keras is Keras 3 in them, as "
                  "tfpar's strategies need.\n")
    if gpus_per_worker == 0 and gpus is None:
        # CPU workers: the host's GPUs are hidden from them, not listed (nvidia-smi can take
        # 30 s, which a notice would wait for; CUDA_VISIBLE_DEVICES is not theirs).
        return {slot: "" for slot in range(num_workers)}
    host_gpus, listing_note = ((list(gpus), None) if gpus is not None
                               else gpus_lib.gpu_listing(os.environ))
    given, idle = gpus_lib.shares(host_gpus, num_workers, gpus_per_worker)
    if listing_note:
        out.write(f"launcher: {listing_note}\n")
    if idle:
        out.write(f"{idle}\n")
    return given


@dataclasses.dataclass
class _Job:
    """A launched job's rounds: each starts the slots running, and what its chief declared and
    saved (:mod:`tfpar.worker_contract`) decides the next."""

    command: Sequence[str]
    host: str
    out: TextIO
    all_output: bool
    network: str
    gpus: dict[int, str]
    records: str
    """The folder of the rounds' worker specs."""
    restarts: bool = False
    """Whether a failed round is started again (restarts, or an elastic job)."""
    known: Progress = dataclasses.field(default_factory=Progress)
    """The last progress a chief's folder showed."""
    rounds: int = 0

    def round(self, state: JobState) -> Decision:
        """Runs one round of ``state``'s slots; the decision after it."""
        self.rounds += 1  # Each round's chief declares itself in a file of its own.
        spec = os.path.join(self.records, f"worker_spec_{self.rounds}.json")
        group = WorkerGroup(self.command, state.slots.running, self.host, self.out,
                            self.all_output, self.network,
                            preemption.DEFAULT_GRACE_SECONDS + PREEMPTION_MARGIN_SECONDS,
                            self.gpus, _growth_due(state.slots, spec, self.known),
                            spec, grace_margin=PREEMPTION_MARGIN_SECONDS,
                            restarts=self.restarts)
        try:
            check_signals()  # A signal before or between rounds: no worker is running.
            result = group.run()
        except SignalTaken as stop:
            result = _between_rounds(stop.signum, group)
        declared = worker_contract.WorkerSpec.read(spec)
        self.known = progress_of(declared, self.known)
        if declared is not None and state.slots.sizes is None:
            state.slots.sizes = declared.worker_counts(state.slots.minimum,
                                                       state.slots.maximum)
        return decide(result, self.known, state)


def _between_rounds(signum: int, group: WorkerGroup) -> RoundResult:
    """A signal the launcher took while no worker was running."""
    if signum == signal.SIGINT:
        group.say("launcher: interrupted; no worker was running.")
        return RoundResult(Outcome.INTERRUPTED, ExitStatus.INTERRUPTED)
    group.say("launcher: preemption notice while no worker was running; the saved state is "
              "where a rerun resumes.")
    return RoundResult(Outcome.NOTICE, ExitStatus.PREEMPTED, workers_ran=False)


def progress_of(spec: worker_contract.WorkerSpec | None, before: Progress) -> Progress:
    """A round's progress: from where the round before left the job (``before``) to the
    position record of the folder the round's chief declared (``spec``; none declared: the
    round did not begin training, and nothing moved)."""
    start = before.after if before.folder is not None else None
    if spec is None or not spec.folder:
        return Progress(start, start, before.folder, recorded=False)
    position = worker_contract.read_position(spec.folder)
    return Progress(start if spec.folder == before.folder else None,
                    position.pair if position is not None else None, spec.folder)


def _growth_due(slots: elastic.WorkerSlots, spec: str, before: Progress
                ) -> Callable[[], str | None] | None:
    """While slots are lost: the round's check of whether the job should grow now
    (:func:`~tfpar.cluster.restart_policy.growth_due` of the position saved in the folder the
    chief declared at ``spec``); else ``None``."""
    if not slots.lost:
        return None
    return lambda: growth_due(progress_of(worker_contract.WorkerSpec.read(spec), before), slots)








def _check_launch(command: Sequence[str], num_workers: int, min_workers: int | None, host: str,
                  network: str, max_restarts: int) -> None:
    """Raises :class:`ConfigError` for what :func:`launch` cannot run (see its Raises)."""
    if not command:
        raise ConfigError("The command to run is empty: give the program and its arguments, "
                          "e.g. tfpar-train --strategy=multi_worker.")
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1. Received: {num_workers}.")
    if min_workers is not None and not 1 <= min_workers <= num_workers:
        raise ConfigError(f"The fewest workers of an elastic job must be from 1 to num_workers "
                          f"({num_workers}). Received: min_workers={min_workers}.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"{{argument}} must be an integer >= 0. Received: "
                          f"{{argument}}={max_restarts!r}.", argument="max_restarts")
    if network not in NETWORKS:
        raise ConfigError(f"Unknown network {network!r}. Allowed: {', '.join(NETWORKS)}.")
    if network == "private" and not _is_loopback(host):
        raise ConfigError(f"A private network has only loopback: host must be a loopback "
                          f"address such as 127.0.0.1. Received: {host!r}. Use network 'host' "
                          "for another address.")
