"""A local launcher: N worker processes of one command on loopback, with TF_CONFIG each.

It picks free ports, gives each worker its ``TF_CONFIG``, prefixes every output line with the
worker's rank, and supervises: if a worker fails or is killed, the others are stopped and the
launcher reports which worker failed; Ctrl-C or SIGTERM stops every worker. Workers run in
their own process groups, so nothing they start outlives the launcher; and a launcher that is
killed outright (``kill -9``, the out-of-memory killer) takes its workers with it (Linux's
parent-death signal), so a launcher run again never shares a model folder with orphans.

With ``max_restarts`` it restarts the whole group after a failure, as ``torchrun
--max-restarts`` does: the failed worker's peers are stopped and every worker starts again with
fresh ports, resuming from the last state its command's ``--model_dir`` holds.

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
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import TextIO

from tfpar.cluster import elastic
from tfpar.cluster import failures as failures_lib
from tfpar.cluster import preemption
from tfpar.cluster import private_network
from tfpar.cluster import worker_environment
from tfpar.cluster.peers import PRIVATE_NETWORK_ENV
from tfpar.errors import ConfigError
from tfpar.errors import PeerLostError
from tfpar.errors import PortTakenError

STOP_GRACE_SECONDS = 15.0
"""After the launcher stops the workers (SIGINT), how long a worker may take to stop before it is
killed (a worker gives itself tfpar.cli.common.STOP_GRACE_SECONDS when blocked inside
TensorFlow).
"""
PREEMPTION_MARGIN_SECONDS = 10.0
"""After a preemption (a worker stopped for a notice, or a notice to the launcher), how long the
other workers may take to save and exit, beyond their own grace budget, before they are killed.
"""
NOTICES = (signal.SIGTERM, signal.SIGUSR1)
"""The signals the launcher itself takes as preemption notices and passes on (as SIGTERM)."""
NETWORKS = ("private", "host")
"""Where the launcher's workers run: a private loopback network, or the machine's."""
PORT_ATTEMPTS = 3
"""How many times the launcher starts over with fresh ports when a worker finds its port taken
(host network).
"""
GROWTH_CHECK_SECONDS = 0.2
"""How often a shrunk elastic job's saved state is read for an epoch boundary at which to try
its lost workers again (the sooner the notice, the fewer steps of the new epoch run short)."""
ALL_OUTPUT_ENV = "TFPAR_ALL_WORKERS_OUTPUT"
"""Set to "1" in the workers' environment to have every worker print its progress and report
(tfpar's programs otherwise print them on the chief only).
"""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ConfigError(f"Cannot open a port on host {host!r} ({reason}): the workers run on "
                          "this machine, so give one of its addresses, e.g. 127.0.0.1.") from None
    finally:
        for s in sockets:
            s.close()


def tf_configs(num_workers: int, host: str = "127.0.0.1") -> list[str]:
    """Returns each worker's ``TF_CONFIG`` for a cluster of ``num_workers`` on ``host``."""
    workers = [f"{host}:{port}" for port in free_ports(num_workers, host)]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            for i in range(num_workers)]


# Exit statuses that end a job without a restart: success, and bad input (exit 2: the same
# command fails the same way again). A worker stopped by a signal of its own (130: Ctrl-C or
# SIGTERM to a program that takes no preemption notice) is restarted; the user's Ctrl-C to the
# launcher is not (_Interrupted).
_NO_RESTART = (0, 2)
INTERRUPTED_STATUS = 130
"""The launcher's status after Ctrl-C."""


class _Interrupted(Exception):
    """The launcher itself was told to stop (Ctrl-C); every worker is stopped."""


class _Preempted(Exception):
    """The launcher itself had a preemption notice; every worker was given it.

    Attributes:
        status: What the workers exited with (the preempted status once they saved).
    """

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


_CHECKPOINT_STATE = re.compile(r'^model_checkpoint_path: "(?:.*/)?(ckpt-(\d+))"', re.M)
_POSITIONS_FILE = "positions.json"  # tfpar.callbacks.EpochCheckpoint.POSITIONS_FILE


def flag_of(command: Sequence[str], name: str) -> str | None:
    """The value of ``--name`` in a command line (``--name=V`` or ``--name V``), or ``None``."""
    for i, arg in enumerate(command):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1] or None
        if arg == f"--{name}" and i + 1 < len(command):
            return command[i + 1]
    return None


def model_dir_of(command: Sequence[str]) -> str | None:
    """The ``--model_dir`` a tfpar training command carries, or ``None``."""
    return flag_of(command, "model_dir")


def last_saved_position(model_dir: str) -> tuple[int, int]:
    """The furthest training position saved in ``model_dir`` by any of its runs: ``(epochs
    finished, steps of the next epoch)``, ``(0, 0)`` for none; read from TensorFlow's checkpoint
    state files and tfpar's positions file (no TensorFlow needed)."""
    positions = [(0, 0)]
    with contextlib.suppress(OSError):
        for run in ["", *os.listdir(model_dir)]:  # The folder itself, or a run's folder.
            folder = os.path.join(model_dir, run)
            with contextlib.suppress(OSError):
                with open(os.path.join(folder, "checkpoint"), encoding="utf-8") as f:
                    saved = _CHECKPOINT_STATE.findall(f.read())
                known: dict = {}
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(folder, _POSITIONS_FILE), encoding="utf-8") as f:
                        known = json.load(f)
                # Without a positions file (older states), checkpoints are numbered by epoch.
                positions += [tuple(known.get(name, (int(number), 0)))
                              for name, number in saved]
    return max(positions)


def last_saved_epoch(model_dir: str) -> int:
    """The last epoch finished in the state saved in ``model_dir`` (0: none)."""
    return last_saved_position(model_dir)[0]


def _position_words(position: tuple[int, int]) -> str:
    epochs, steps = position
    return f"epoch {epochs}" if not steps else f"epoch {epochs + 1} step {steps}"


def _forward(stream, prefix: str, out: TextIO, lock: threading.Lock,
             said_lost: list[int]) -> None:
    """Copies a worker's output lines to ``out`` behind ``prefix``; the workers a line says
    stopped answering go into ``said_lost``."""
    for line in iter(stream.readline, ""):
        said_lost.extend(failures_lib.workers_said_lost(line))
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def _stop(processes: Sequence[subprocess.Popen], signum: int = signal.SIGINT,
          grace: float = STOP_GRACE_SECONDS) -> None:
    """Sends ``signum`` to every running worker's process group (SIGINT: stop now, as Ctrl-C
    does; SIGTERM: a preemption notice), then kills those still running after ``grace``."""
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signum)
    _wait(processes, grace)


class _Notice(Exception):
    """A preemption notice to the launcher (raised by its handler in the main thread)."""


def _notice(signum, frame):
    raise _Notice


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
           resumes_itself: bool = False, min_workers: int | None = None) -> int:
    """Runs ``command`` as ``num_workers`` workers and supervises them.

    Args:
        command: The program and its arguments, e.g. ``["python", "scripts/train.py", ...]``.
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
            from the last state saved in the command's ``--model_dir``, which it must carry
            unless ``resumes_itself``. A job preempted after saving progress (its workers
            exited with the preempted status) is restarted too, without counting a failure.
            For an elastic job, the restarts at each number of workers.
        resumes_itself: The command resumes by itself when started again (a user's script
            with Keras's ``BackupAndRestore`` or tfpar's ``EpochCheckpoint``): restarts need no
            ``--model_dir`` in it.
        min_workers: The fewest workers an elastic job goes on with (``None``: as many as
            ``num_workers``, not elastic). When a worker fails once more than ``max_restarts``
            allows, it is lost and the others go on from the last saved state, while at least
            ``min_workers`` remain; lost workers are tried again at the next restart, or at an
            epoch boundary (after 1 epoch, then 2, 4, ... while they keep failing); with a
            ``--model_dir`` the launcher sees the epochs, without one only restarts grow the
            job. The worker for whom a peer said it stopped answering is the one blamed.

    Returns:
        0 if every worker succeeded; else the failing worker's exit status (or 128 + signal);
        130 after Ctrl-C to the launcher; the preempted status
        (:data:`tfpar.cluster.preemption.PREEMPTED_EXIT_STATUS`) after a notice to the
        launcher, once the workers saved, or after a preemption it does not restart.

    Raises:
        ConfigError: If the command is empty or cannot be run, ``num_workers`` < 1,
            ``min_workers`` is not from 1 to ``num_workers``, ``host`` is not an address of
            this machine (or not loopback on a private network), a private network cannot be
            made here, or restarts (``max_restarts``, or an elastic job) are asked without
            ``--model_dir`` in the command nor ``resumes_itself``.
    """
    model_dir = model_dir_of(command)
    _check_launch(command, num_workers, min_workers, host, network, max_restarts,
                  model_dir if model_dir is not None or not resumes_itself else "")
    slots = elastic.WorkerSlots(num_workers if min_workers is None else min_workers, num_workers)
    out = out or sys.stdout
    if worker_environment.legacy_keras_asked():
        out.write(f"launcher: {worker_environment.LEGACY_KERAS_ENV} (Ray's TensorflowTrainer sets "
                  "it) is not passed to the workers: tf.keras is Keras 3 in them, as tfpar's "
                  "strategies need.\n")
    grace = _grace_of(command) + PREEMPTION_MARGIN_SECONDS
    failures = 0
    while True:
        before = last_saved_position(model_dir) if model_dir is not None else None
        try:
            status, rank = _launch_once(command, slots, host, out, all_output, network, grace,
                                        _growth_due(slots, model_dir, before))
        except _Interrupted:
            return INTERRUPTED_STATUS
        except _Preempted as e:
            out.write(f"launcher: preempted; the workers exited with {e.status}"
                      + (f", the state saved at {_position_words(last_saved_position(model_dir))}"
                         f" in {model_dir}" if model_dir is not None else "") + ".\n")
            return e.status
        after = last_saved_position(model_dir) if model_dir is not None else None
        progressed = before is not None and after is not None and after > before
        if progressed:
            slots.settled()
        if status == _GROWING:  # A fresh budget of restarts at the new size.
            failures = 0
            which = f"growing back to {_workers(len(slots.running) + len(slots.lost))}"
            back = slots.rejoin()
            which += f" (slot {_listed(back)} {'rejoins' if len(back) == 1 else 'rejoin'})"
        elif status in _NO_RESTART or not (max_restarts or slots.elastic):
            return status
        elif status == preemption.PREEMPTED_EXIT_STATUS and (before is None or progressed):
            which = ("the job was preempted after saving; starting every worker again (not "
                     "counted as a failure)") + _rejoining(slots)
        else:
            epochs_done = after[0] if after is not None else 0
            slot = slots.slot_of(rank)
            if slot in slots.rejoining and not progressed:  # A trial: no restart used.
                slots.lose(slot, epochs_done)
                which = (f"slot {slot} failed again on rejoining, so it is lost"
                         + _next_try(slots, model_dir) + "; going on with "
                         f"{_workers(len(slots.running))} of {slots.maximum}")
            else:
                failures += 1
                if failures > max_restarts and not slots.can_lose(slot):
                    out.write(_end_line(slots, slot, max_restarts, status))
                    return status
                if failures > max_restarts:
                    size = len(slots.running)
                    slots.lose(slot, epochs_done)
                    failures = 0
                    which = (f"the restarts at {_workers(size)} are used up ({max_restarts} of "
                             f"{max_restarts}): slot {slot} is lost"
                             + _next_try(slots, model_dir) + "; going on with "
                             f"{_workers(len(slots.running))} of {slots.maximum} (at least "
                             f"{slots.minimum}) at the same global batch")
                else:
                    which = (f"restart {failures} of {max_restarts}: starting every worker again"
                             + _rejoining(slots))
        if after is None:  # Checked above: the command resumes by itself.
            out.write(f"launcher: {which}; the command resumes by itself.\n")
        else:
            out.write(f"launcher: {which}, "
                      + (f"resuming from {_position_words(after)} in {model_dir}.\n"
                         if after != (0, 0)
                         else f"from scratch (no epoch saved in {model_dir} yet).\n"))
        out.flush()


def _end_line(slots: elastic.WorkerSlots, slot: int, max_restarts: int, status: int) -> str:
    """The launcher's last line when the restarts are used up and ``slot`` cannot be lost."""
    used = f"({max_restarts} of {max_restarts})"
    if not slots.elastic:
        return (f"launcher: restarts used up {used}; exiting with the failed worker's status "
                f"({status}).\n")
    return (f"launcher: the restarts at {_workers(len(slots.running))} are used up {used} and "
            f"without slot {slot} {_workers(len(slots.running) - 1)} would be left, fewer than "
            f"the minimum of {slots.minimum}; exiting with the failed worker's status "
            f"({status}).\n")


_GROWING = -1000
"""What a start of the workers returns when it stopped them to grow the job back."""


def _workers(count: int) -> str:
    return f"{count} worker{'s' * (count != 1)}"


def _listed(slots: Sequence[int]) -> str:
    return ", ".join(map(str, slots))


def _rejoining(slots: elastic.WorkerSlots) -> str:
    """Puts lost slots back for a restart; their words for its line."""
    back = slots.rejoin()
    return (f" with {_workers(len(slots.running))}, slot {_listed(back)} rejoining" if back
            else "")


def _next_try(slots: elastic.WorkerSlots, model_dir: str | None) -> str:
    return (f" (tried again after epoch {slots.next_try_epochs} or at a restart)"
            if model_dir is not None else " (tried again at a restart)")


def _growth_due(slots: elastic.WorkerSlots, model_dir: str | None,
                start: tuple[int, int] | None) -> Callable[[], str | None] | None:
    """While slots are lost: a check of whether the job has reached the epoch boundary at which
    they are tried again (an epoch saved during this start, at or past the slots' next try),
    which returns that boundary in words; else ``None``."""
    if not slots.lost or model_dir is None or start is None:
        return None

    def due() -> str | None:
        epochs = last_saved_position(model_dir)[0]
        if epochs > start[0] and epochs >= slots.next_try_epochs:
            return f"epoch {epochs} is saved"
        return None

    return due


def _grace_of(command: Sequence[str]) -> float:
    """The preemption grace budget the command's workers take (tfpar's flag, else default)."""
    with contextlib.suppress(TypeError, ValueError):
        return float(flag_of(command, "preemption_grace_seconds"))  # type: ignore[arg-type]
    return preemption.DEFAULT_GRACE_SECONDS


def _check_launch(command: Sequence[str], num_workers: int, min_workers: int | None, host: str,
                  network: str, max_restarts: int, model_dir: str | None) -> None:
    """Raises :class:`ConfigError` for what :func:`launch` cannot run (see its Raises)."""
    if not command:
        raise ConfigError("The command to run is empty: give the program and its arguments, "
                          "e.g. python scripts/train.py --strategy=multi_worker.")
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1. Received: {num_workers}.")
    if min_workers is not None and not 1 <= min_workers <= num_workers:
        raise ConfigError(f"The fewest workers of an elastic job must be from 1 to num_workers "
                          f"({num_workers}). Received: min_workers={min_workers}.")
    if min_workers is not None and min_workers < num_workers and model_dir is None:
        raise ConfigError(f"An elastic job ({min_workers} to {num_workers} workers) goes on "
                          "from its last saved state: the command must carry --model_dir=DIR "
                          "(where the epochs are saved), or, if it resumes by itself (Keras's "
                          "BackupAndRestore, tfpar's EpochCheckpoint), set {argument}.",
                          argument="resumes_itself")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"{{argument}} must be an integer >= 0. Received: "
                          f"{{argument}}={max_restarts!r}.", argument="max_restarts")
    if max_restarts and model_dir is None:
        raise ConfigError(f"Restarts (max_restarts={max_restarts}) resume the job from its last "
                          "saved epoch: the command must carry --model_dir=DIR (where the "
                          "epochs are saved), or, if it resumes by itself (Keras's "
                          "BackupAndRestore, tfpar's EpochCheckpoint), set {argument}.",
                          argument="resumes_itself")
    if network not in NETWORKS:
        raise ConfigError(f"Unknown network {network!r}. Allowed: {', '.join(NETWORKS)}.")
    if network == "private" and not _is_loopback(host):
        raise ConfigError(f"A private network has only loopback: host must be a loopback "
                          f"address such as 127.0.0.1. Received: {host!r}. Use network 'host' "
                          "for another address.")


def _launch_once(command: Sequence[str], slots: elastic.WorkerSlots, host: str, out: TextIO,
                 all_output: bool, network: str, grace: float,
                 growth_due: Callable[[], str | None] | None) -> tuple[int, int]:
    """One start of the workers of ``slots.running`` (again with new ports where a port was
    taken): the status and the rank of the worker it is about (see :func:`_supervise`)."""
    with contextlib.ExitStack() as stack:
        namespace = (stack.enter_context(private_network.Namespace())
                     if network == "private" else None)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            configs = tf_configs(len(slots.running), host)
            if namespace is None:
                ports = ", ".join(json.loads(configs[0])["cluster"]["worker"])
                out.write(f"launcher: the workers' TensorFlow servers listen on every network "
                          f"interface, unauthenticated ({ports}): firewall these ports.\n")
            status, rank = _run(command, configs, slots.running, out, all_output, namespace,
                                grace, growth_due)
            if status != PortTakenError.exit_status or namespace is not None:
                return status, rank
            out.write(f"launcher: a worker's port was taken by another program; starting "
                      f"again with new ports (attempt {attempt + 1} of {PORT_ATTEMPTS}).\n"
                      if attempt < PORT_ATTEMPTS else
                      "launcher: a worker's port was taken every time; giving up.\n")
        return status, rank


def _run(command: Sequence[str], configs: Sequence[str], slots: Sequence[int], out: TextIO,
         all_output: bool, namespace: private_network.Namespace | None, grace: float,
         growth_due: Callable[[], str | None] | None) -> tuple[int, int]:
    """Starts one worker per ``TF_CONFIG`` (in ``slots``) and supervises them (see
    :func:`launch`)."""
    lock = threading.Lock()
    processes = _start_workers(command, configs, slots, all_output, namespace)
    said_lost: dict[int, list[int]] = {}
    threads = []
    for rank, p in enumerate(processes):
        t = threading.Thread(target=_forward, args=(p.stdout, f"[worker {rank}] ", out, lock,
                                                    said_lost.setdefault(rank, [])),
                             daemon=True)
        t.start()
        threads.append(t)
    try:
        return _supervise(processes, out, lock, grace, said_lost, growth_due, slots)
    finally:
        for t in threads:
            t.join(timeout=5)


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _worker_set_up(namespace: private_network.Namespace | None) -> Callable[[], None]:
    """What a worker's process does between ``fork`` and ``exec``: joins the private network
    (if any) and asks Linux to kill it when the launcher dies."""
    launcher_pid = os.getpid()
    try:  # Looked up before the fork: the child only calls it.
        prctl = ctypes.CDLL(None).prctl
    except (AttributeError, OSError):  # Not Linux: no parent-death signal.
        prctl = None

    def set_up() -> None:
        if namespace is not None:
            namespace.enter()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher_pid:  # The launcher died before the request took.
            os.kill(os.getpid(), signal.SIGKILL)

    return set_up


def _start_workers(command: Sequence[str], configs: Sequence[str], slots: Sequence[int],
                   all_output: bool,
                   namespace: private_network.Namespace | None) -> list[subprocess.Popen]:
    """One process of ``command`` per ``TF_CONFIG`` (and slot), each its own session, output
    piped.

    Raises:
        ConfigError: If the command cannot be run (the workers started are stopped).
    """
    processes: list[subprocess.Popen] = []
    for config, slot in zip(configs, slots):
        env = worker_environment.worker_environment({
            "TF_CONFIG": config, "PYTHONUNBUFFERED": "1", elastic.SLOT_ENV: str(slot),
            ALL_OUTPUT_ENV: "1" if all_output else "0",
            PRIVATE_NETWORK_ENV: "1" if namespace else "0"})
        try:
            # Started before any output thread, so the fork runs preexec_fn single-threaded.
            processes.append(subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, start_new_session=True, preexec_fn=_worker_set_up(namespace)))
        except (OSError, subprocess.SubprocessError) as e:
            _stop(processes)
            reason = getattr(e, "strerror", None) or e
            raise ConfigError(f"Cannot run {command[0]!r}: {reason}. Give a program on "
                              "PATH or its path, e.g. -- python scripts/train.py.") from None
    return processes


def _supervise(processes: list[subprocess.Popen], out: TextIO, lock: threading.Lock,
               grace: float, said_lost: dict[int, list[int]] | None = None,
               growth_due: Callable[[], str | None] | None = None,
               slots: Sequence[int] | None = None) -> tuple[int, int]:
    """Waits for the workers; returns the job's status and the rank of the worker it is about.

    0 when all succeed; the first failure stops the others and returns its status, about the
    worker a failing worker said stopped answering (``said_lost``), else about itself; a worker
    preempted lets the others finish saving (``grace`` seconds at most) and returns the
    preempted status; when ``growth_due`` (checked every :data:`GROWTH_CHECK_SECONDS`) says
    why, every worker is given a notice, and once they saved :data:`_GROWING` is returned.
    Ctrl-C stops them all and raises
    :class:`_Interrupted`; a notice to the launcher is passed on and raises
    :class:`_Preempted` once they exited. ``slots``: the workers' slots, to name them (their
    ranks by default)."""
    slots = list(slots or range(len(processes)))
    # Python takes signals in the main thread only: a launcher run from another thread (a Ray
    # worker's train loop) leaves notices to whoever runs that one.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = ({signum: signal.signal(signum, _notice) for signum in NOTICES}
                if in_main_thread else {})
    next_check = time.monotonic() + GROWTH_CHECK_SECONDS
    try:
        while True:
            for rank, p in enumerate(processes):
                code = p.poll()
                if code == preemption.PREEMPTED_EXIT_STATUS:
                    with lock:
                        out.write(f"launcher: {elastic.worker_words(rank, slots)} stopped for a "
                                  "preemption notice "
                                  f"(exit {code}); waiting for the others to save.\n")
                    _wait(processes, grace)
                    return code, rank
                if code not in (None, 0):
                    _stop(processes)
                    status = 128 - code if code < 0 else code
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
                    named = [r for r in (said_lost or {}).get(rank, []) if r < len(processes)]
                    about = (named[0] if code == PeerLostError.exit_status and named
                             else rank)
                    with lock:
                        out.write(f"launcher: {elastic.worker_words(rank, slots)} {how}"
                                  + (f" ({elastic.worker_words(about, slots)} stopped "
                                     "answering)" if about != rank else "")
                                  + "; stopped the other workers.\n")
                    return status, about
            if all(p.poll() == 0 for p in processes):
                return 0, 0
            if growth_due is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + GROWTH_CHECK_SECONDS
                why = growth_due()
                if why:
                    with lock:
                        out.write(f"launcher: {why}; a notice to every worker to save and stop, "
                                  "to try the lost slots again.\n")
                    _stop(processes, signal.SIGTERM, grace)
                    if all(p.returncode == 0 for p in processes):  # The job ended meanwhile.
                        return 0, 0
                    return _GROWING, 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(processes)
        with lock:
            out.write("launcher: interrupted; stopped every worker.\n")
        raise _Interrupted from None
    except _Notice:
        for signum in NOTICES:  # One notice is enough.
            signal.signal(signum, signal.SIG_IGN)
        with lock:
            out.write("launcher: preemption notice; passed to every worker, waiting for them "
                      "to save.\n")
        _stop(processes, signal.SIGTERM, grace)
        codes = [p.returncode for p in processes]
        preempted = preemption.PREEMPTED_EXIT_STATUS
        raise _Preempted(preempted if preempted in codes else max(codes)) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """Waits up to ``grace`` seconds for every worker to exit by itself; kills the rest."""
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
