"""Preemption notices: the signal a scheduler sends before it ends a job, and the step at which
every worker of the job stops.

Slurm sends SIGTERM (or the signal of ``--signal``) before a time limit or a preemption and
SIGKILL some seconds later; Kubernetes sends SIGTERM and kills after the pod's
``terminationGracePeriodSeconds``; spot machines give a notice of seconds to minutes. A notice
here is one of the signals :func:`watch_signals` was given. Its handler only records it (so the
step in progress finishes), and a *grace budget* starts: if the process has not ended within
it, it ends with one line saying the last complete state is where a rerun resumes.

A job's workers must stop at the same step, or the ones that go on wait for ever in the next
step's collective. The first worker that sees a notice at a step boundary, after ``n`` steps
(calls of the training function) since training began, announces ``n + 1`` in TensorFlow's
coordination service and waits until every worker has acknowledged it, as TensorFlow's
``PreemptionCheckpointHandler`` does: since steps are synchronous, no worker can have finished
step ``n + 1`` before that, so every worker stops after exactly ``n + 1``. Workers that see no
notice pay nothing per step (a thread of theirs waits on the service). One process alone stops
at its next step boundary.

A process that stops for a notice exits with :data:`PREEMPTED_EXIT_STATUS`, distinct from a
failure, so a launcher, ``sbatch --requeue`` script or Kubernetes ``podFailurePolicy`` can tell a
preemption (run it again: it resumes) from a crash or bad input.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence

from absl import logging

from tfpar.cluster import protocol
from tfpar.cluster import signal_router
from tfpar.compat import coordination_values
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus

PREEMPTED_EXIT_STATUS = int(ExitStatus.PREEMPTED)
"""The status a process exits with after stopping for a notice ("preempted: run again to resume").
"""
DEFAULT_GRACE_SECONDS = 25.0
"""Seconds from a notice to the end of the process: below Kubernetes' default grace period (30 s)
with room for the interpreter to exit.
"""
NOTICE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "none")
"""The notice signals tfpar's programs watch besides SIGTERM (Slurm's --signal sends the one
chosen); "none" watches SIGTERM only.
"""
DEFAULT_NOTICE_SIGNAL = "SIGUSR1"
"""The second notice signal watched by default (besides SIGTERM)."""

_KEY_PREFIX = "tfpar/preemption"


class Preempted(SystemExit):
    """Raised after a preemption notice, once the state is saved (or nothing was to be
    saved): the process exits with :data:`PREEMPTED_EXIT_STATUS`, no traceback.

    Attributes:
        message: The one line printed for it.
    """

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT_STATUS)
        self.message = message


def notice_signals(second: str) -> tuple[signal.Signals, ...]:
    """SIGTERM and the configured second notice signal (``"none"``: SIGTERM only).

    Raises:
        ConfigError: If ``second`` is not one of :data:`NOTICE_SIGNALS`.
    """
    if second not in NOTICE_SIGNALS:
        raise ConfigError(f"{{argument}} must be one of {', '.join(NOTICE_SIGNALS)}. Received: "
                          f"{second!r}.", argument="preemption_signal")
    return (signal.SIGTERM,) if second == "none" else (signal.SIGTERM, signal.Signals[second])


def check_grace_seconds(seconds: float) -> None:
    """Raises unless ``seconds`` is a number > 0.

    Raises:
        ConfigError: Naming the argument.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError(f"{{argument}} must be a number of seconds > 0. Received: "
                          f"{seconds!r}.", argument="preemption_grace_seconds")


class _Notices:
    """The process's notices: what arrived, when, and the grace budget's end (one per process,
    as signal handlers are)."""

    def __init__(self):
        self.signals: tuple[signal.Signals, ...] = ()
        self.grace_seconds = DEFAULT_GRACE_SECONDS
        self.arrived = threading.Event()
        self.name = ""  # The first notice's signal name.
        self.arrived_at = 0.0  # time.monotonic() of the first notice.
        self.stopping = threading.Event()  # The process said why it stops; the budget is quiet.
        self.last_saved: str | None = None  # The last complete state, in words.
        self.last_position: tuple[int, int] | None = None  # ... as (epochs, steps).
        self.training = 0  # Training loops under way that will stop at a step boundary.
        # Each watch_signals: the signals and budget before it, and the handlers it replaced.
        self.watches: list[tuple[tuple[signal.Signals, ...], float, dict, bool]] = []
        self.exit_process = False  # See watch_signals.
        self.listening = False  # Arrivals reach record() through the signal router.
        self.lock = threading.Lock()
        self.generation = 0  # Counts resets: a budget started before one ends nothing.

    def reset(self) -> None:
        with self.lock:
            self.generation += 1
            self.arrived.clear()
            self.stopping.clear()
            self.name, self.arrived_at, self.last_saved = "", 0.0, None
            self.last_position = None

    def record(self, signum: int, blocking: bool = True) -> None:
        """Called from the signal's arrival (any thread): records the first notice and starts
        the grace budget. From a signal handler (``blocking=False``) it never waits for the
        lock: the main thread may hold it where the handler interrupted it, and the router's
        thread records the same arrival anyway."""
        if not self.lock.acquire(blocking=blocking):
            return
        try:
            if self.arrived.is_set():
                return
            self.name = signal.Signals(signum).name
            self.arrived_at = time.monotonic()
            self.arrived.set()
            generation = self.generation
        finally:
            self.lock.release()
        threading.Thread(target=self._end_when_budget_is_spent, args=(generation,),
                         name="tfpar-preemption-budget", daemon=True).start()

    def seconds_left(self) -> float:
        return max(0.0, self.arrived_at + self.grace_seconds - time.monotonic())

    def _end_when_budget_is_spent(self, generation: int) -> None:
        time.sleep(self.seconds_left())
        if generation != self.generation:  # Forgotten (reset) since.
            return
        if not self.stopping.is_set():
            saved = (f"{self.last_saved} is intact and is where a rerun resumes"
                     if self.last_saved else "nothing was saved before")
            line = (f"Preempted ({self.name}): the state could not be saved within the "
                    f"{self.grace_seconds:g} s grace budget; {saved}.")
            print(line, file=sys.stderr, flush=True)
            protocol.record_stop(PREEMPTED_EXIT_STATUS, line, position=self.last_position,
                                 work_lost=True)
        os._exit(PREEMPTED_EXIT_STATUS)


_notices = _Notices()


def _on_signal(signum, frame):
    """The Python-level handler of a notice signal (runs in the main thread). It never blocks
    (see :meth:`_Notices.record`)."""
    _notices.record(signum, blocking=False)
    if not _notices.training:  # No training loop will stop at a step: stop here.
        saved = (f"{_notices.last_saved} is where a rerun resumes" if _notices.last_saved
                 else "no training step had run since the start, so nothing new was to be saved")
        name = _notices.name or signal.Signals(signum).name
        raise stopping(f"Preempted ({name}) outside training: {saved}.")


def _on_arrival(signum: int) -> None:
    """Learns of every notice as it arrives, from the signal router's thread, even while the
    main thread is inside TensorFlow (where Python handlers wait)."""
    if signum in _notices.signals:
        _notices.record(signum)


def _start_listening() -> None:
    if not _notices.listening:
        signal_router.on_arrival(_on_arrival)
        _notices.listening = True


def watch_signals(signals: Sequence[int], grace_seconds: float = DEFAULT_GRACE_SECONDS, *,
                  exit_process: bool | None = None) -> bool:
    """Treats ``signals`` as preemption notices in this process (see the module docstring).

    Until the matching :func:`unwatch_signals`, a notice outside a training loop stops the
    process at once (:class:`Preempted`); inside one (see :func:`training`), at a step
    boundary. Calls nest: the innermost signals and budget apply.

    Args:
        signals: The notice signals, e.g. ``notice_signals("SIGUSR1")``.
        grace_seconds: Seconds from a notice to the end of the process at the latest.
        exit_process: After training stopped and saved for a notice, end the process at once
            (a program such as ``tfpar-train``) rather than raise :class:`Preempted`; ``None``
            keeps what an outer watch chose (raise, by default).

    Returns:
        Whether the signals are watched: handlers can be set in the main thread only
        (elsewhere, e.g. in a Ray worker's training thread, this logs why and does nothing).
    """
    check_grace_seconds(grace_seconds)
    if threading.current_thread() is not threading.main_thread():
        logging.info("Preemption notices are not watched: signal handlers can be set in the "
                     "main thread only.")
        return False
    _start_listening()
    _notices.watches.append((_notices.signals, _notices.grace_seconds,
                             signal_router.install({s: _on_signal for s in signals}),
                             _notices.exit_process))
    if exit_process is not None:
        _notices.exit_process = exit_process
    _notices.grace_seconds = float(grace_seconds)
    _notices.signals = tuple(signal.Signals(s) for s in signals)
    return True


def unwatch_signals() -> None:
    """Ends the innermost :func:`watch_signals`: its signals get back their handlers."""
    if threading.current_thread() is not threading.main_thread() or not _notices.watches:
        return
    (_notices.signals, _notices.grace_seconds, previous,
     _notices.exit_process) = _notices.watches.pop()
    signal_router.install(previous)


def watching(signum: int) -> bool:
    """Whether ``signum`` is a notice this process watches now."""
    return signum in _notices.signals


def reset() -> None:
    """Forgets the notice and cancels its grace budget, for a process that handled
    :class:`Preempted` and goes on (a test, a notebook)."""
    _notices.reset()


def noticed() -> bool:
    """Whether a preemption notice has arrived in this process."""
    return _notices.arrived.is_set()


def notice_name() -> str:
    """The first notice's signal name (``""`` before any)."""
    return _notices.name


def seconds_since_notice() -> float:
    """Seconds since the first notice (0 before any)."""
    return time.monotonic() - _notices.arrived_at if noticed() else 0.0


def saved(description: str, position: tuple[int, int] | None = None) -> None:
    """Records the last complete state, in words (``"epoch 2 step 17 in DIR"``) and as
    ``(epochs finished, steps of the next epoch)``, for the line the grace budget prints if the
    process must end before the next save is done, and for the process's stop record."""
    _notices.last_saved, _notices.last_position = description, position


def stopping(message: str) -> Preempted:
    """Prints ``message`` (the process's one line), records the stop for a launcher
    (:func:`tfpar.cluster.protocol.record_stop`) and returns the exception to raise."""
    _notices.stopping.set()
    print(message, file=sys.stderr, flush=True)
    protocol.record_stop(PREEMPTED_EXIT_STATUS, message, position=_notices.last_position)
    return Preempted(message)


def exit_now(before: Callable[[], object] | None = None) -> None:
    """Ends the process at once with :data:`PREEMPTED_EXIT_STATUS`, after ``before()`` (e.g.
    the chief waiting for its peers to leave) and flushing standard output and error.

    Unwinding ``fit`` instead (raising :class:`Preempted`) frees its input iterators in the
    main thread, where TensorFlow can wait tens of seconds for their threads (seen: 40 s with
    ResNet-18), past a scheduler's grace period; the state is saved already.
    """
    try:
        if before is not None:
            before()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(PREEMPTED_EXIT_STATUS)


def exits_process() -> bool:
    """Whether the program watching the notices asked to end the process at once after a
    preemption's save (:func:`watch_signals`'s ``exit_process``), rather than raise."""
    return _notices.exit_process


def training(active: bool) -> None:
    """Marks the start (``True``) or end (``False``) of a training loop that stops at a step
    boundary after a notice: inside one, a notice only records itself."""
    _notices.training += 1 if active else -1


class StopStep:
    """Where the workers of one training run stop after a notice: the step every one of them
    stops after, agreed through the coordination service (see the module docstring).

    Args:
        run: A name of this training run, the same on every worker and new for each run of
            the process (e.g. a count of runs), so runs never read each other's keys.
        task: This worker's index among ``num_workers`` (0 alone).
        num_workers: Worker processes of the job (1: no agreement needed).
    """

    def __init__(self, run: str, task: int = 0, num_workers: int = 1):
        self._key = f"{_KEY_PREFIX}/{run}/stop_after"
        self._ack = f"{_KEY_PREFIX}/{run}/acknowledged/"
        self._task, self._num_workers = task, num_workers
        self._coordinated = num_workers > 1 and coordination_values.available()
        self._announced = threading.Event()  # Some worker's announcement has been read.
        self._value: str | None = None
        self._stop_after: int | None = None
        self._finished = False
        if self._coordinated:
            threading.Thread(target=self._watch, name=f"tfpar-preemption-{run}",
                             daemon=True).start()

    def _watch(self) -> None:
        value = coordination_values.wait_for(self._key)
        if value is None:  # The job ended.
            return
        self._value = value  # Before the acknowledgement, which lets the announcer go on.
        self._announced.set()
        coordination_values.insert(f"{self._ack}{self._task}", "1")

    def stop_after(self, steps_done: int) -> int | None:
        """The step (count of steps since training began) to stop after, once known.

        Call it at every step boundary with the steps done so far. The worker that sees a
        notice first announces ``steps_done + 1`` and waits for every worker to acknowledge
        it (within the grace budget; past it the process ends).

        Returns:
            The step to stop after, or ``None`` while no notice is known.
        """
        if self._stop_after is not None or self._finished:
            return self._stop_after
        if self._announced.is_set():
            self._stop_after = self._read(self._value)
        elif noticed():
            if not self._coordinated:
                self._stop_after = steps_done
            elif coordination_values.insert(self._key, str(steps_done + 1)):
                for task in range(self._num_workers):
                    if coordination_values.wait_for(f"{self._ack}{task}",
                                                    _notices.seconds_left() + 1) is None:
                        logging.warning("Worker %d did not acknowledge the stop step.", task)
                self._stop_after = steps_done + 1
            else:  # Another worker announced first; this worker's watcher reads it.
                self._announced.wait(_notices.seconds_left() + 1)
                self._stop_after = self._read(self._value)
        return self._stop_after

    def _read(self, value: str | None) -> int | None:
        if value is None or not value.isdigit():  # "finished": the run ended first.
            self._finished = True
            return None
        return int(value)

    def finish(self) -> None:
        """Ends the run's watch (training ended): releases the watcher thread."""
        self._finished = True
        if self._coordinated and not self._announced.is_set():
            coordination_values.insert(self._key, "finished")
