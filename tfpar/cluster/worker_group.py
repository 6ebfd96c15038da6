"""One round of a launcher's workers: start them, watch them, stop them, say how it ended.

A :class:`WorkerGroup` starts one process of the command per running slot (free ports and a
``TF_CONFIG`` each, on a private loopback network or the host's, each worker's share of the
host's GPUs, a stop-record path), copies their output behind ``[worker N]``, and watches them
until the round ends (:meth:`WorkerGroup.run`), returning a
:class:`~tfpar.cluster.restart_policy.RoundResult`:

- every worker exited 0: succeeded;
- a worker exited with the preempted status: the others are left to finish saving (the grace
  budget), preempted, with every worker's status and whether a stop record says the notice's
  state could not be saved;
- a worker failed: the others are stopped (SIGINT, then SIGKILL after a grace), failed, with
  the workers its stop record says stopped answering;
- the launcher had a notice (SIGTERM, SIGUSR1; through :mod:`.signal_router`): it is passed to
  every worker as SIGTERM, they save and exit, and the status is what they ended with
  (:func:`~tfpar.cluster.restart_policy.notice_status`, which the policy works out again
  knowing whether training had begun), with every worker's status;
- Ctrl-C to the launcher: every worker is stopped;
- an elastic job's epoch boundary at which lost slots are tried again (``growth_due``, the
  restart policy's rule, says so): every worker is given a notice, and once they saved,
  growing.

It reports what happened; what follows (new ports, whom a failure is counted against,
growing) is the restart policy's (:func:`~tfpar.cluster.restart_policy.decide`).

Workers run in their own sessions (so Ctrl-C at the terminal reaches the launcher only, which
stops them) and die with the launcher (Linux's parent-death signal), so nothing they start
outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TextIO

from tfpar import worker_contract
from tfpar.cluster import elastic
from tfpar.cluster import private_network
from tfpar.cluster import signal_router
from tfpar.cluster import worker_environment
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import RoundResult
from tfpar.cluster.restart_policy import notice_status
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus

STOP_GRACE_SECONDS = 15.0
"""After the launcher stops the workers (SIGINT), how long a worker may take to stop before it is
killed (a worker gives itself tfpar.cli.common.STOP_GRACE_SECONDS when blocked inside
TensorFlow).
"""
NOTICES = (signal.SIGTERM, signal.SIGUSR1)
"""The signals the launcher itself takes as preemption notices and passes on (as SIGTERM)."""
POLL_SECONDS = 0.1
"""How often the workers and the launcher's signals are looked at."""
GROWTH_CHECK_SECONDS = 0.2
"""How often a shrunk elastic job's saved state is read for an epoch boundary at which to try
its lost workers again (the sooner the notice, the fewer steps of the new epoch run short)."""


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


class SignalTaken(Exception):
    """The launcher took a signal (Ctrl-C, a notice) at one of its safe points.

    Attributes:
        signum: The signal.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def check_signals() -> None:
    """Raises :class:`SignalTaken` for a signal the launcher took (Ctrl-C before a notice)."""
    taken = signal_router.take()
    if signal.SIGINT in taken:
        raise SignalTaken(signal.SIGINT)
    if taken:
        raise SignalTaken(taken[0])


def _restarted_itself() -> bool:
    """Whether this launcher runs as a worker of another that restarts it (a launcher in a
    launched command): its workers are restarted with it, so they are told so too."""
    return (worker_contract.SLOT_ENV in os.environ
            and os.environ.get(worker_contract.RESTARTS_ENV) == "1")


class WorkerGroup:
    """Starts and watches one round of workers (see the module docstring).

    Args:
        command: The program and its arguments.
        slots: The slots of the workers to start, in rank order.
        host: Their address.
        out: Where their prefixed output and the group's lines go.
        all_output: Every worker prints progress, not only the chief.
        network: ``"private"`` or ``"host"``.
        grace: Seconds the workers get to save and exit after a notice.
        gpus: Each slot's ``CUDA_VISIBLE_DEVICES`` (none given where absent).
        growth_due: Checked every :data:`GROWTH_CHECK_SECONDS` while slots are lost: why the
            job should grow now (``None``: not yet).
        worker_spec: Where the chief declares its :class:`~tfpar.worker_contract.WorkerSpec`
            (:data:`~tfpar.worker_contract.WORKER_SPEC_ENV`; ``None``: nowhere).
        grace_margin: Where the chief declared its grace budget, the workers get that budget
            plus this margin after a notice, instead of ``grace``.
        restarts: The job is started again after a failure
            (:data:`~tfpar.worker_contract.RESTARTS_ENV` tells the workers).
    """

    def __init__(self, command: Sequence[str], slots: Sequence[int], host: str, out: TextIO,
                 all_output: bool, network: str, grace: float,
                 gpus: Mapping[int, str] | None = None,
                 growth_due: Callable[[], str | None] | None = None,
                 worker_spec: str | None = None, grace_margin: float = 0.0,
                 restarts: bool = False):
        self.restarts = restarts
        self.command, self.slots, self.host, self.out = list(command), list(slots), host, out
        self.worker_spec, self.grace_margin = worker_spec, grace_margin
        self.all_output, self.network, self.grace = all_output, network, grace
        self.gpus, self.growth_due = dict(gpus or {}), growth_due
        self._lock = threading.Lock()

    def _notice_grace(self) -> float:
        """Seconds the workers get to save and exit after a notice: the grace budget the chief
        declared plus the margin, else ``grace``."""
        declared = (worker_contract.WorkerSpec.read(self.worker_spec)
                    if self.worker_spec else None)
        if declared is None or declared.grace_seconds is None:
            return self.grace
        return declared.grace_seconds + self.grace_margin

    def say(self, line: str) -> None:
        """Writes one launcher line."""
        with self._lock:
            self.out.write(f"{line}\n")
            self.out.flush()

    def run(self) -> RoundResult:
        """Runs the round.

        Raises:
            ConfigError: If the command cannot be run, or a private network not made here.
        """
        with contextlib.ExitStack() as stack:
            namespace = (stack.enter_context(private_network.Namespace())
                         if self.network == "private" else None)
            records = tempfile.mkdtemp(prefix="tfpar-launch-")
            stack.callback(shutil.rmtree, records, True)
            configs = tf_configs(len(self.slots), self.host)
            if namespace is None:
                ports = ", ".join(json.loads(configs[0])["cluster"]["worker"])
                self.say(f"launcher: the workers' TensorFlow servers listen on every network "
                         f"interface, unauthenticated ({ports}): firewall these ports.")
            return self._round(configs, namespace, records)

    def _round(self, configs: Sequence[str], namespace: private_network.Namespace | None,
               records: str) -> RoundResult:
        record_paths = [os.path.join(records, f"worker-{rank}.json")
                        for rank in range(len(configs))]
        processes = self._start(configs, namespace, record_paths)
        threads = [threading.Thread(target=self._forward, args=(p.stdout, f"[worker {rank}] "),
                                    daemon=True) for rank, p in enumerate(processes)]
        for t in threads:
            t.start()
        try:
            return self._watch(processes, record_paths)
        except SignalTaken as stop:
            return self._stopped(processes, stop.signum, record_paths)
        finally:
            for t in threads:
                t.join(timeout=5)

    def _start(self, configs: Sequence[str], namespace: private_network.Namespace | None,
               record_paths: Sequence[str]) -> list[subprocess.Popen]:
        """One process of the command per ``TF_CONFIG``, each its own session, output piped.

        Raises:
            ConfigError: If the command cannot be run (the workers started are stopped).
        """
        processes: list[subprocess.Popen] = []
        for rank, (config, slot, record) in enumerate(zip(configs, self.slots, record_paths)):
            variables = {
                worker_contract.TF_CONFIG_ENV: config, "PYTHONUNBUFFERED": "1",
                worker_contract.SLOT_ENV: str(slot), worker_contract.STOP_RECORD_ENV: record,
                worker_contract.ALL_OUTPUT_ENV: "1" if self.all_output else "0",
                worker_contract.PRIVATE_NETWORK_ENV: "1" if namespace else "0",
                worker_contract.RESTARTS_ENV: "1" if self.restarts or _restarted_itself() else "0"}
            if slot in self.gpus:
                variables[worker_contract.VISIBLE_GPUS_ENV] = self.gpus[slot]
            if self.worker_spec:  # The chief's; none for the others, whatever the launcher had.
                variables[worker_contract.WORKER_SPEC_ENV] = self.worker_spec if rank == 0 else ""
            env = worker_environment.worker_environment(variables)
            try:
                # Started before any output thread, so the fork runs preexec_fn single-threaded.
                processes.append(subprocess.Popen(
                    self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, start_new_session=True, preexec_fn=_worker_set_up(namespace)))
            except (OSError, subprocess.SubprocessError) as e:
                stop(processes)
                reason = getattr(e, "strerror", None) or e
                raise ConfigError(f"Cannot run {self.command[0]!r}: {reason}. Give a program on "
                                  "PATH or its path, e.g. -- tfpar-train.") from None
        return processes

    def _forward(self, stream, prefix: str) -> None:
        for line in iter(stream.readline, ""):
            with self._lock:
                self.out.write(f"{prefix}{line}")
                self.out.flush()
        stream.close()

    def _who(self, rank: int) -> str:
        return elastic.worker_words(rank, self.slots)

    def _watch(self, processes: list[subprocess.Popen],
               record_paths: Sequence[str]) -> RoundResult:
        next_check = time.monotonic() + GROWTH_CHECK_SECONDS
        while True:
            check_signals()
            for rank, p in enumerate(processes):
                code = p.poll()
                if code == ExitStatus.PREEMPTED:
                    self.say(f"launcher: {self._who(rank)} stopped for a preemption notice "
                             f"(exit {code}); waiting for the others to save.")
                    wait(processes, self._notice_grace())
                    # Whether its save ran out of grace, and how the others ended, are in
                    # their records and statuses: the policy says what the round was.
                    records = [worker_contract.StopRecord.read(path) for path in record_paths]
                    lost_by = tuple(i for i, r in enumerate(records)
                                    if r is not None and r.work_lost)
                    return RoundResult(
                        Outcome.PREEMPTED, code, rank, work_lost=bool(lost_by),
                        statuses=tuple(worker_contract.normalized(p.returncode) for p in processes),
                        lost_by=lost_by)
                if code not in (None, 0):
                    stop(processes)
                    status = worker_contract.normalized(code)
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
                    record = worker_contract.StopRecord.read(record_paths[rank])
                    result = RoundResult(Outcome.FAILED, status, rank, unresponsive=tuple(
                        r for r in (record.unresponsive if record else ())
                        if r < len(processes)))
                    self.say(f"launcher: {self._who(rank)} {how}"
                             + (f" ({self._who(result.blamed)} stopped answering)"
                                if result.blamed != rank else "")
                             + "; stopped the other workers.")
                    return result
            if all(p.poll() == 0 for p in processes):
                return RoundResult(Outcome.SUCCEEDED)
            if self.growth_due is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + GROWTH_CHECK_SECONDS
                why = self.growth_due()
                if why:
                    self.say(f"launcher: {why}; a notice to every worker to save and stop, to "
                             "try the lost slots again.")
                    stop(processes, signal.SIGTERM, self._notice_grace())
                    if all(p.returncode == 0 for p in processes):  # The job ended meanwhile.
                        return RoundResult(Outcome.SUCCEEDED)
                    return RoundResult(Outcome.GROWING)
            time.sleep(POLL_SECONDS)

    def _stopped(self, processes: list[subprocess.Popen], signum: int,
                 record_paths: Sequence[str]) -> RoundResult:
        """Stops every worker for the launcher's own signal (Ctrl-C, or a notice passed on)."""
        if signum == signal.SIGINT:
            stop(processes)
            self.say("launcher: interrupted; stopped every worker.")
            return RoundResult(Outcome.INTERRUPTED, ExitStatus.INTERRUPTED)
        self.say("launcher: preemption notice; passed to every worker, waiting for them to save.")
        stop(processes, signal.SIGTERM, self._notice_grace())
        statuses = [worker_contract.normalized(p.returncode) for p in processes]
        records = [worker_contract.StopRecord.read(path) for path in record_paths]
        return RoundResult(Outcome.NOTICE, notice_status(statuses),
                           work_lost=any(r is not None and r.work_lost for r in records),
                           statuses=tuple(statuses))


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


def stop(processes: Sequence[subprocess.Popen], signum: int = signal.SIGINT,
         grace: float = STOP_GRACE_SECONDS) -> None:
    """Sends ``signum`` to every running worker's process group (SIGINT: stop now, as Ctrl-C
    does; SIGTERM: a preemption notice), then kills those still running after ``grace``."""
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signum)
    wait(processes, grace)


def wait(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """Waits up to ``grace`` seconds for every worker to exit by itself; kills the rest. A
    Ctrl-C to the launcher meanwhile stops them at once (SIGINT, a short grace)."""
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if signal_router.take(signal.SIGINT):
            for p in processes:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGINT)
            deadline = min(deadline, time.monotonic() + STOP_GRACE_SECONDS)
        time.sleep(POLL_SECONDS)
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()
