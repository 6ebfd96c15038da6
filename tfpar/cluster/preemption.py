"""Preemption notices, from the signal to the exit: :class:`Notice` (one per process,
:data:`NOTICE`) and the step at which every worker of the job stops (:class:`StopStep`).

Slurm sends SIGTERM (or the signal of ``--signal``) before a time limit or a preemption and
SIGKILL some seconds later; Kubernetes sends SIGTERM and kills after the pod's
``terminationGracePeriodSeconds``; spot machines give a notice of seconds to minutes. A notice
here is one of the signals :meth:`Notice.watch` was given. The signal router's handler only
records it (so the step in progress finishes), and a *grace budget* starts: if the process has
not ended within it, it ends with one line saying the last complete state is where a rerun
resumes. Outside training a notice ends the process at once (nothing is in flight to save).

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

Why one module of this length: a notice's life (the signal, the grace budget, the step every
worker agrees on, the lines a stop says) is one state machine, :class:`Notice`, with
:class:`StopStep`, the agreement it waits on; the signal's handler itself is
:mod:`.signal_router`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

from absl import logging

from tfpar import worker_contract
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
MAX_GRACE_SECONDS = worker_contract.MAX_GRACE_SECONDS
"""The largest grace budget accepted: a day (schedulers give seconds to minutes). Waits on the
budget go through the interpreter's clocks and timers, which cannot hold an infinite wait, nor
one of about 10**10 s and beyond.
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
    """Raises unless ``seconds`` is a finite number > 0 and at most :data:`MAX_GRACE_SECONDS`.

    Raises:
        ConfigError: Naming the argument.
    """
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
            or not 0 < seconds <= MAX_GRACE_SECONDS):
        raise ConfigError(f"{{argument}} must be a finite number of seconds > 0 and at most "
                          f"{MAX_GRACE_SECONDS:g} (a day). Received: {seconds!r}.",
                          argument="preemption_grace_seconds")


class Notice:
    """A process's preemption notice, from its signal to the process's exit: the one place it is
    handled.

    Its life: :meth:`watch` makes signals notices (its handler, set through the signal router,
    only records them); a notice's arrival reaches :meth:`arrive` from the router's thread at once,
    even while the main thread is inside TensorFlow, and starts the grace budget. Outside a
    training loop the process then ends at once (its line, its stop record, the preempted
    status): nothing is in flight to save. Inside one (:meth:`loop_started`), the loop's
    :class:`StopStep` agrees with the other workers on the step to stop after
    (:meth:`stop_step`), the state is saved there (its position record committed), and the
    loop ends the process (:meth:`announce_stop`, then :meth:`exit` or raising
    :class:`Preempted`). If the budget runs out first, the process ends saying which saved
    state is intact.

    There is one per process, :data:`NOTICE`, as there is one handler per signal.
    """

    def __init__(self):
        self._signals: tuple[signal.Signals, ...] = ()
        self._grace_seconds = DEFAULT_GRACE_SECONDS
        self._arrived = threading.Event()
        self._recorded: list[int] = []  # Appended by the handler (the main thread), no lock.
        # Each notice signal reaches the handler and, apart, the router's thread: the two
        # counts, and the router's arrivals still to come for notices a reset forgot.
        self._handled = 0
        self._routed = 0
        self._stale = 0
        self._name = ""  # The first notice's signal name.
        self._arrived_at = 0.0  # time.monotonic() of the first notice.
        self._stopping = threading.Event()  # The process said why it stops; the budget is quiet.
        # This process's saves committed before (worker_contract.commits_made at a reset):
        # the notice's lines name only those after.
        self._commits_before = worker_contract.commits_made()
        self._stop_position: tuple[int, int] | None = None  # Where the notice's state goes.
        self._in_flight: worker_contract.Position | None = None  # A save under way.
        # Held while a committed save's position is recorded: a spent budget waits for it, so
        # that its line and the position record name the same state.
        self._ending_held = threading.Lock()
        self._training = 0  # Training loops under way that will stop at a step boundary.
        # Each watch: the signals, budget and exit choice before it, and whether it subscribed.
        self._watches: list[tuple[tuple[signal.Signals, ...], float, bool, bool]] = []
        self._exit_process = False  # See watch.
        self._listening = False  # Arrivals reach arrive() through the signal router.
        self._lock = threading.Lock()
        self._generation = 0  # Counts resets: a budget started before one ends nothing.

    def watch(self, signals: Sequence[int], grace_seconds: float = DEFAULT_GRACE_SECONDS, *,
              exit_process: bool | None = None) -> bool:
        """Treats ``signals`` as preemption notices in this process until the matching
        :meth:`unwatch`. Calls nest: the innermost signals and budget apply.

        Args:
            signals: The notice signals, e.g. ``notice_signals("SIGUSR1")``.
            grace_seconds: Seconds from a notice to the end of the process at the latest.
            exit_process: After training stopped and saved for a notice, end the process at
                once (a program such as ``tfpar-train``) rather than raise
                :class:`Preempted`; ``None`` keeps what an outer watch chose (raise, by
                default).

        Returns:
            Whether the signals are watched: handlers can be set in the main thread only
            (elsewhere, e.g. in a Ray worker's training thread, this logs why and does
            nothing).
        """
        check_grace_seconds(grace_seconds)
        if not signal_router.in_main_thread():
            logging.info("Preemption notices are not watched: signal handlers can be set in "
                         "the main thread only.")
            return False
        if not self._listening:
            signal_router.on_arrival(self._routed_arrival)
            self._listening = True
        self._watches.append((self._signals, self._grace_seconds, self._exit_process,
                              signal_router.subscribe(signals, self._record)))
        if exit_process is not None:
            self._exit_process = exit_process
        self._grace_seconds = float(grace_seconds)
        worker_contract.declare(grace_seconds=self._grace_seconds)  # The launcher waits so long.
        self._signals = tuple(signal.Signals(s) for s in signals)
        # Notices a program recorded from its first import of tfpar, before this watch.
        for signum in signal_router.take_early(self._signals):
            self._record(signum, None)
        if self._recorded and not self._arrived.is_set():
            self.arrive(self._recorded[0])
        return True

    def unwatch(self) -> None:
        """Ends the innermost :meth:`watch`: its signals get back their handlers."""
        if not signal_router.in_main_thread() or not self._watches:
            return
        (self._signals, self._grace_seconds, self._exit_process,
         subscribed) = self._watches.pop()
        if self._signals:  # The outer watch's budget is the one a launcher waits for again.
            worker_contract.declare(grace_seconds=self._grace_seconds)
        if subscribed:
            signal_router.unsubscribe()

    @contextlib.contextmanager
    def handed_over(self) -> Iterator[None]:
        """Inside, the caller takes this process's notice signals itself (a launcher, which
        passes them on to its workers): an arrival is not a notice here. Enter it once the
        caller's own handlers are set (:func:`~tfpar.cluster.signal_router.subscribe`), so
        that no notice falls between the two."""
        signals, self._signals = self._signals, ()
        try:
            yield
        finally:
            self._signals = signals

    def watching(self, signum: int) -> bool:
        """Whether ``signum`` is a notice this process watches now."""
        return signum in self._signals

    def loop_started(self) -> None:
        """Marks the start of a training loop that stops at a step boundary after a notice:
        until :meth:`loop_ended`, a notice only records itself (the loop's :class:`StopStep`
        acts on it) instead of ending the process."""
        self._training += 1

    def loop_ended(self) -> None:
        """Marks the end of a training loop :meth:`loop_started` marked."""
        self._training -= 1

    def _mark_training(self, active: bool) -> None:
        """0.3's ``training(active)``: :meth:`loop_started` or :meth:`loop_ended`."""
        if active:
            self.loop_started()
        else:
            self.loop_ended()

    def _record(self, signum: int, frame: Any) -> None:
        """The notice signals' handler (main thread): records, nothing else (no lock, no
        exception), so that the next step boundary knows of it even before the router's thread
        has called :meth:`arrive`."""
        if signum in self._signals:
            self._recorded.append(signum)
            if frame is not None:  # A signal's own call, not a replay of an early one.
                self._handled += 1

    def _routed_arrival(self, signum: int) -> None:
        """The router's thread's arrival of a signal: :meth:`arrive`, unless it is the late
        arrival of a notice already taken in from the handler's record and forgotten since
        (:meth:`reset`), which would otherwise be a second notice (outside training, the
        end of the process that went on)."""
        if signum not in self._signals:
            return
        with self._lock:
            self._routed += 1
            if self._stale:
                self._stale -= 1
                return
        self.arrive(signum)

    def arrive(self, signum: int) -> None:
        """A signal arrived (called from the signal router's thread, or by a test): a notice
        is recorded and its grace budget starts; outside training the process ends here."""
        if signum not in self._signals:
            return
        with self._lock:
            if self._arrived.is_set():
                return
            self._name = signal.Signals(signum).name
            self._arrived_at = time.monotonic()
            self._arrived.set()
            generation = self._generation
        threading.Thread(target=self._end_when_budget_is_spent, args=(generation,),
                         name="tfpar-preemption-budget", daemon=True).start()
        if not self._training:  # No training loop will stop at a step: stop here.
            last = self._last_committed()
            saved = (f"{last.where} is where a rerun resumes" if last else
                     "no training step had run since the start, so nothing new was to be "
                     "saved")
            self.announce_stop(f"Preempted ({self._name}) outside training: {saved}.")
            self.exit()

    @property
    def has_arrived(self) -> bool:
        """Whether a notice has arrived in this process (a read; nothing else)."""
        return self._arrived.is_set()

    def arrived_at_step_boundary(self) -> bool:
        """Whether a notice has arrived, asked by a training loop at a step boundary (a safe
        point): a notice the handler recorded is taken in here if the router's thread has not
        yet, so the loop stops at the step after the one the signal interrupted. (Outside a
        training loop, taking a notice in ends the process, as :meth:`arrive` does.)"""
        if not self._arrived.is_set() and self._recorded:
            self.arrive(self._recorded[0])
        return self._arrived.is_set()

    @property
    def signal_name(self) -> str:
        """The first notice's signal name (``""`` before any)."""
        return self._name

    def seconds_since(self) -> float:
        """Seconds since the first notice (0 before any)."""
        return time.monotonic() - self._arrived_at if self.has_arrived else 0.0

    def seconds_left(self) -> float:
        """Seconds left of the grace budget (the whole budget before a notice)."""
        if not self.has_arrived:
            return self._grace_seconds
        return max(0.0, self._arrived_at + self._grace_seconds - time.monotonic())

    def stop_step(self, run: str, task: int = 0, num_workers: int = 1) -> StopStep:
        """The step a training loop's workers stop after on a notice (see :class:`StopStep`)."""
        return StopStep(run, task, num_workers, notice=self)

    @contextlib.contextmanager
    def ending_held(self) -> Iterator[None]:
        """Holds off the end of a spent grace budget (at most :data:`TELLING_WAIT_SECONDS`)
        while a committed save's position is recorded
        (:func:`tfpar.worker_contract.commit_position`), so that the notice's line and the
        position record the launcher reads name the same state."""
        with self._ending_held:
            yield

    @contextlib.contextmanager
    def saving(self, position: worker_contract.Position) -> Iterator[None]:
        """Inside, a save of ``position`` is under way (from its first write to its position
        record): a grace budget spent meanwhile says that a rerun resumes there if the save
        committed, else at the last committed one, since which of the two the folder holds is
        not known."""
        self._in_flight = position
        try:
            yield
        finally:
            self._in_flight = None

    def stop_at(self, position: tuple[int, int]) -> None:
        """Records the position the notice's state is saved at (the step the job agreed on),
        ``(epochs finished, steps of the next epoch)``: once a save of it is committed, a grace
        budget that runs out afterwards (while the saver cleans up, or the process ends) lost
        nothing."""
        self._stop_position = position

    def _last_committed(self) -> worker_contract.Position | None:
        """This process's last committed save since the notice was last reset."""
        return worker_contract.last_committed(self._commits_before)

    def _stop_saved(self) -> bool:
        """Whether the notice's state is committed (see :meth:`stop_at`)."""
        last = self._last_committed()
        return last is not None and last.pair == self._stop_position

    def announce_stop(self, message: str) -> Preempted:
        """Prints ``message`` (the process's one line), records the stop for a launcher
        (:func:`tfpar.cluster.worker_contract.record_stop`) and returns the exception to raise."""
        self._stopping.set()
        print(message, file=sys.stderr, flush=True)
        worker_contract.record_stop(PREEMPTED_EXIT_STATUS, message)
        return Preempted(message)

    @property
    def exits_process(self) -> bool:
        """Whether the program watching the notices asked to end the process at once after a
        preemption's save (:meth:`watch`'s ``exit_process``), rather than raise."""
        return self._exit_process

    def exit(self, before: Callable[[], object] | None = None) -> None:
        """Ends the process at once with :data:`PREEMPTED_EXIT_STATUS`, after ``before()``
        (e.g. the chief waiting for its peers to leave) and flushing standard output and error.

        Unwinding ``fit`` instead (raising :class:`Preempted`) frees its input iterators in the
        main thread, where TensorFlow can wait tens of seconds for their threads (seen: 40 s
        with ResNet-18), past a scheduler's grace period; the state is saved already.
        """
        try:
            if before is not None:
                before()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(PREEMPTED_EXIT_STATUS)

    def reset(self) -> None:
        """Forgets the notice and cancels its grace budget, for a process that handled
        :class:`Preempted` and goes on (a test, a notebook)."""
        with self._lock:
            self._generation += 1
            self._arrived.clear()
            self._recorded.clear()
            # Notices the handler recorded whose arrival the router's thread has not yet made.
            self._stale = max(0, self._handled - self._routed)
            self._stopping.clear()
            self._name, self._arrived_at = "", 0.0
            self._commits_before = worker_contract.commits_made()
            self._stop_position = None

    def _end_when_budget_is_spent(self, generation: int) -> None:
        time.sleep(self.seconds_left())
        if generation != self._generation:  # Forgotten (reset) since.
            return
        # A save being made known (committed, the launcher not yet told) is let finish.
        self._ending_held.acquire(timeout=TELLING_WAIT_SECONDS)
        last = self._last_committed()
        if not self._stopping.is_set() and self._stop_saved():
            line = (f"Preempted ({self._name}): the notice's state was saved "
                    f"({last.where if last else ''}, where a rerun resumes); the "
                    f"{self._grace_seconds:g} s grace budget ran out as the process ended, "
                    "with nothing lost.")
            print(line, file=sys.stderr, flush=True)
            worker_contract.record_stop(PREEMPTED_EXIT_STATUS, line)
        elif not self._stopping.is_set():
            saved = (f"{last.where} is intact and is where a rerun resumes"
                     if last else "nothing was saved before")
            in_flight = self._in_flight
            if in_flight is not None:
                before = last.where if last else "the start (nothing was saved before)"
                saved = (f"the save of {in_flight.where} was under way, so a rerun resumes "
                         f"there if it committed, else at {before}")
            line = (f"Preempted ({self._name}): the state could not be saved within the "
                    f"{self._grace_seconds:g} s grace budget; {saved}.")
            print(line, file=sys.stderr, flush=True)
            worker_contract.record_stop(PREEMPTED_EXIT_STATUS, line, work_lost=True)
        os._exit(PREEMPTED_EXIT_STATUS)


TELLING_WAIT_SECONDS = 2.0
"""How long a spent grace budget waits for a committed save to be made known (well within the
launcher's margin before it kills a worker)."""

NOTICE = Notice()
"""This process's preemption notice (see :class:`Notice`)."""

# The module's functions before the notice was one object: name -> the Notice member now.
_MOVED = {"watch_signals": "watch", "unwatch_signals": "unwatch", "watching": "watching",
          "reset": "reset", "noticed": "arrived_at_step_boundary", "notice_name": "signal_name",
          "seconds_since_notice": "seconds_since", "stopping": "announce_stop",
          "exit_now": "exit", "exits_process": "exits_process",
          "training": "_mark_training"}


def _saved(description: str, position: tuple[int, int] | None = None) -> None:
    """0.3's ``saved``: the notice now reads the saver's committed position, here the one
    given, else the one the description names (``"epoch 3 step 17 in DIR"``, ``"the end of
    epoch 2 in DIR"``)."""
    words, _, folder = description.partition(" in ")
    if position is None:
        end = re.fullmatch(r"(?:the end of )?epoch (\d+)", words.strip())
        inside = re.fullmatch(r"epoch (\d+) step (\d+)", words.strip())
        if inside:
            position = (int(inside[1]) - 1, int(inside[2]))
        elif end:
            position = (int(end[1]), 0)
        else:
            return
    worker_contract.commit_position(folder, worker_contract.Position(*position), write=False)


def __getattr__(name: str) -> Any:
    if name == "saved":
        warnings.warn("tfpar.cluster.preemption.saved is deprecated and will be removed in "
                      "0.5.0: use tfpar.worker_contract.commit_position.",
                      DeprecationWarning, stacklevel=2)
        return _saved
    if name in _MOVED:
        use = ("loop_started() and NOTICE.loop_ended()" if name == "training"
               else _MOVED[name])
        warnings.warn(f"tfpar.cluster.preemption.{name} is deprecated and will be removed in "
                      f"0.5.0: use tfpar.cluster.preemption.NOTICE.{use}.",
                      DeprecationWarning, stacklevel=2)
        member = getattr(NOTICE, _MOVED[name])
        return member if callable(member) else (lambda: getattr(NOTICE, _MOVED[name]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StopStep:
    """Where the workers of one training run stop after a notice: the step every one of them
    stops after, agreed through the coordination service (see the module docstring).

    Args:
        run: A name of this training run, the same on every worker and new for each run of
            the process (e.g. a count of runs), so runs never read each other's keys.
        task: This worker's index among ``num_workers`` (0 alone).
        num_workers: Worker processes of the job (1: no agreement needed).
        notice: The notice it acts on (default: this process's, :data:`NOTICE`).
    """

    def __init__(self, run: str, task: int = 0, num_workers: int = 1,
                 notice: Notice | None = None):
        self._notice = notice or NOTICE
        self._key = f"{_KEY_PREFIX}/{run}/stop_after"
        self._ack = f"{_KEY_PREFIX}/{run}/acknowledged/"
        self._task, self._num_workers = task, num_workers
        self._coordinated = (num_workers > 1
                             and coordination_values.skip_reason() is None)
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
        elif self._notice.arrived_at_step_boundary():
            if not self._coordinated:
                self._stop_after = steps_done
            elif coordination_values.insert(self._key, str(steps_done + 1)):
                for task in range(self._num_workers):
                    if coordination_values.wait_for(f"{self._ack}{task}",
                                                    self._notice.seconds_left() + 1) is None:
                        logging.warning("Worker %d did not acknowledge the stop step.", task)
                self._stop_after = steps_done + 1
            else:  # Another worker announced first; this worker's watcher reads it.
                self._announced.wait(self._notice.seconds_left() + 1)
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
