"""What the launcher does after each round of workers: a pure function of what happened.

A *round* is one start of the job's workers, until they all exited (:mod:`.worker_group`). Its
:class:`RoundResult` (how it ended, the status, the worker that stopped it and whom its record
names), the training position saved before and after it (:class:`Progress`) and the job's
bookkeeping (:class:`JobState`: slots, failures so far, restarts allowed, ports taken) decide
the next step (:func:`decide`): exit with a status, or start another round, with new ports (a
port taken), maybe with fewer workers (a slot lost) or more (lost slots rejoining, when
:func:`growth_due` says so during a round). Each decision carries the one line the launcher
prints for it, written by :mod:`.restart_lines` from what the rule decided, so a rule and the
line it gives are tested together, with no processes (the table test runs in well under a
second).
"""

from __future__ import annotations

import copy
import dataclasses
import enum

from tfpar.cluster import elastic
from tfpar.cluster import restart_lines as lines
from tfpar.errors import ExitStatus


class Outcome(enum.Enum):
    """How a round of workers ended."""

    SUCCEEDED = "succeeded"
    """Every worker exited 0."""
    FAILED = "failed"
    """A worker failed (a non-zero status other than the preempted one); the others were
    stopped."""
    PREEMPTED = "preempted"
    """A worker stopped for a preemption notice (the job agreed on a step and saved); the
    others were left to finish saving."""
    GROWING = "growing"
    """The launcher gave every worker a notice to try lost slots again at an epoch boundary,
    and they saved and stopped."""
    NOTICE = "notice"
    """The launcher itself had a preemption notice, passed it on, and the workers stopped."""
    INTERRUPTED = "interrupted"
    """Ctrl-C to the launcher: every worker was stopped."""


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """How one round ended.

    Attributes:
        outcome: How.
        status: The job's status: the failed worker's (normalised: 128 + N after signal N);
            after a notice to the launcher, the preempted status when every worker saved (or
            finished), else the worst a worker ended with.
        rank: The worker that stopped the round: the one that failed; the first preempted
            one.
    """

    outcome: Outcome
    status: int = 0
    rank: int = 0
    work_lost: bool = False
    """After a preemption: a worker's state could not be saved within the grace budget, so
    the training since the last complete state is lost (its stop record says so)."""
    unresponsive: tuple[int, ...] = ()
    """The workers the failed one's stop record says stopped answering (ranks)."""
    statuses: tuple[int, ...] = ()
    """After a notice or a worker's preemption: every worker's normalised status, by rank
    (empty: only :attr:`status` is known)."""
    lost_by: tuple[int, ...] = ()
    """After a preemption: the workers whose stop records say their state could not be saved
    within the grace budget (ranks; :attr:`rank` is only the first seen to stop)."""
    workers_ran: bool = True
    """Whether the round started workers (``False``: the launcher took a signal while none
    was running, between rounds or before the first)."""

    @property
    def blamed(self) -> int:
        """The worker a failure is counted against: the one the failed worker found had
        stopped answering (it exited with the status that says so), else the failed one."""
        named = [rank for rank in self.unresponsive if rank != self.rank]
        return named[0] if self.status == ExitStatus.PEER_UNAVAILABLE and named else self.rank


@dataclasses.dataclass(frozen=True)
class Progress:
    """The training position (``(epochs finished, steps of the next epoch)``) the round resumed
    from and the last it saved, as its chief recorded them; ``None`` for both where it
    recorded none (a command that resumes by itself with savers other than tfpar's)."""

    before: tuple[int, int] | None = None
    after: tuple[int, int] | None = None
    folder: str | None = None
    """Where that state is, as the chief declared it (``None``: none declared)."""
    recorded: bool = True
    """Whether the round's chief recorded it (so training had begun in this round); ``False``:
    carried over from an earlier round, or none known."""

    @property
    def made(self) -> bool:
        """Whether the round saved something new."""
        return self.before is not None and self.after is not None and self.after > self.before


@dataclasses.dataclass(frozen=True)
class JobState:
    """The launcher's bookkeeping between rounds.

    Attributes:
        slots: The worker slots (which run, which are lost).
        max_restarts: Restarts allowed after failures, at each number of workers.
        failures: Failures counted against them at the current number of workers.
        resumes_itself: The command resumes by itself where its chief declares no folder of
            saved state (a script with a saver of its own); else a restart of such a command
            starts from scratch, and its line says so.
        port_attempts: Rounds in a row whose workers found a port taken.
        program: Whether the command is one of tfpar's programs, which watch for notices from
            their first import of tfpar: a worker the notice's SIGTERM ended had not begun
            training where its chief recorded no progress. A user's own program keeps its
            signals, so the notice's SIGTERM ends it without saving at any moment.
    """

    slots: elastic.WorkerSlots
    max_restarts: int = 0
    failures: int = 0
    resumes_itself: bool = False
    port_attempts: int = 0
    program: bool = True


class Action(enum.Enum):
    """What the launcher does next."""

    EXIT = "exit"
    START = "start"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do after a round, and the line that says it.

    Attributes:
        action: Exit, or start another round with ``state.slots.running``.
        status: The launcher's exit status (with :attr:`Action.EXIT`).
        line: The launcher's line for it (``None``: nothing more to say).
        state: The bookkeeping for the next round.
    """

    action: Action
    status: int
    line: str | None
    state: JobState


PORT_ATTEMPTS = 3
"""How many rounds in a row start with fresh ports when a worker finds its port taken (by
another program: the workers' ports were free a moment before), before that counts as a
failure."""

# Statuses that end a job without a restart: success, and bad input (the same command fails
# the same way again).
NO_RESTART = (ExitStatus.SUCCESS, ExitStatus.BAD_INPUT)


def decide(result: RoundResult, progress: Progress, state: JobState) -> Decision:
    """The launcher's next step after a round (pure: ``state`` is not changed).

    The rules below are tried in order, each for one kind of round; the first that applies
    decides.

    Args:
        result: How the round ended.
        progress: The position saved before and after it.
        state: The bookkeeping before it.

    Returns:
        The decision, with its line and the bookkeeping after it.
    """
    after = _Round(result, progress, state, copy.deepcopy(state.slots), state.failures)
    for rule in (_port_taken, _interrupted, _launcher_notice):
        decision = rule(after)
        if decision is not None:
            return decision
    if progress.made:
        after.slots.settled()
    for rule in (_growing, _refused_size, _finished, _preempted):
        decision = rule(after)
        if decision is not None:
            return decision
    return _failed(after)


@dataclasses.dataclass
class _Round:
    """A round being decided: what happened, and the bookkeeping the decision changes (the
    slots and the failures counted, copies of the state's)."""

    result: RoundResult
    progress: Progress
    state: JobState
    slots: elastic.WorkerSlots
    failures: int

    @property
    def folder(self) -> str | None:
        """Where the job's state is, as its chief declared it (``None``: none declared)."""
        return self.progress.folder

    def exit(self, status: int, line: str | None = None) -> Decision:
        """Exit with ``status``, saying ``line``."""
        return Decision(Action.EXIT, status, line, dataclasses.replace(
            self.state, slots=self.slots, failures=self.failures, port_attempts=0))

    def start(self, which: str) -> Decision:
        """Start another round; ``which`` says what starts, the line adds where it resumes."""
        return Decision(Action.START, 0, lines.start_line(which, self.progress.after,
                                                          self.folder,
                                                          self.state.resumes_itself),
                        dataclasses.replace(self.state, slots=self.slots,
                                            failures=self.failures, port_attempts=0))


def _port_taken(after: _Round) -> Decision | None:
    """A port taken by another program: new ports, not a failure (the last time, one)."""
    result, state = after.result, after.state
    if not (result.outcome is Outcome.FAILED and result.status == ExitStatus.PORT_TAKEN
            and state.port_attempts + 1 < PORT_ATTEMPTS):
        return None
    attempts = state.port_attempts + 1
    return Decision(Action.START, 0, (
        "launcher: a worker's port was taken by another program; starting again with new "
        f"ports (attempt {attempts + 1} of {PORT_ATTEMPTS})."),
        dataclasses.replace(state, port_attempts=attempts))


def _interrupted(after: _Round) -> Decision | None:
    """Ctrl-C to the launcher: exit."""
    if after.result.outcome is not Outcome.INTERRUPTED:
        return None
    return after.exit(ExitStatus.INTERRUPTED)


def _launcher_notice(after: _Round) -> Decision | None:
    """A notice to the launcher: exit with the status the workers' statuses make."""
    result, progress = after.result, after.progress
    if result.outcome is not Outcome.NOTICE:
        return None
    status = (notice_status(list(result.statuses),
                            started=progress.recorded or not after.state.program)
              if result.statuses else result.status)
    return after.exit(status, lines.notice_line(
        status, result.statuses, result.work_lost, result.workers_ran, progress.after,
        after.folder, after.slots))


def _growing(after: _Round) -> Decision | None:
    """Lost slots rejoin at an epoch boundary: start every slot, a fresh budget of restarts."""
    if after.result.outcome is not Outcome.GROWING:
        return None
    after.failures = 0  # A fresh budget of restarts at the new size.
    size = lines.workers(len(after.slots.running) + len(after.slots.lost))
    back = after.slots.rejoin()
    return after.start(f"growing back to {size} (slot {lines.listed(back)} "
                       f"{'rejoins' if len(back) == 1 else 'rejoin'})")


def _refused_size(after: _Round) -> Decision | None:
    """The workers refused the job's size (bad input) after it shrank before its sizes were
    known (its chief had not declared them): set slots aside to a size they allow, no restart
    used."""
    slots = after.slots
    if (after.result.status != ExitStatus.BAD_INPUT or not slots.sizes
            or len(slots.running) in slots.sizes):
        return None
    count = len(slots.running)
    aside = slots.fit_sizes()
    if aside is None:
        return None
    sizes = " or ".join(str(n) for n in sorted(slots.sizes, reverse=True))
    return after.start(f"{lines.workers(count)} cannot run the job (it runs with {sizes} "
                       f"workers, its chief declared): slot {lines.listed(sorted(aside))} set "
                       f"aside; going on with {lines.workers(len(slots.running))} of "
                       f"{slots.maximum}")


def _finished(after: _Round) -> Decision | None:
    """Success, bad input, or a round the job does not restart (no restarts, not elastic):
    exit with its status, a preemption with its line."""
    result = after.result
    if not (result.outcome is Outcome.SUCCEEDED or result.status in NO_RESTART
            or not (after.state.max_restarts or after.slots.elastic)):
        return None
    line = None
    if result.outcome is Outcome.PREEMPTED:
        line = (lines.lost_notice_line(_losers(result, after.slots), after.progress.after,
                                       after.folder) if result.work_lost
                else lines.saved_notice_line(result.status, result.statuses,
                                             after.progress.after, after.folder, after.slots))
    return after.exit(result.status, line)


def _preempted(after: _Round) -> Decision | None:
    """A preemption that saved progress (or whose progress is not known): start every worker
    again, not counted as a failure."""
    result, progress = after.result, after.progress
    if not (result.outcome is Outcome.PREEMPTED
            and (progress.before is None or progress.made)):
        return None
    preempted = ("the job was preempted after saving" if not result.work_lost else
                 f"the job was preempted, but {_losers(result, after.slots)} could not save "
                 "the notice's state within the grace budget (the training since the last save "
                 "is lost)")
    return after.start(f"{preempted}; starting every worker again (not counted as a failure)"
                       + _rejoining(after.slots))


def _losers(result: RoundResult, slots: elastic.WorkerSlots) -> str:
    """The workers whose save ran out of grace, in words (the first seen to stop, where no
    record names them)."""
    return lines.losers(result.lost_by or (result.rank,), slots)


def _set_aside(slots: elastic.WorkerSlots, before: int) -> str:
    """The slots a loss set aside beyond the failed one, in words (none: empty)."""
    return lines.set_aside_words(slots.set_aside[before:], slots.sizes or ())


def _failed(after: _Round) -> Decision:
    """A failure (or a preemption that saved nothing new): a rejoining slot that fails is lost
    again without a restart used; else a restart is counted, and once they are used up the
    blamed slot is lost where the job can go on without it, else the job exits."""
    result, progress, slots = after.result, after.progress, after.slots
    max_restarts = after.state.max_restarts
    epochs_done = progress.after[0] if progress.after is not None else 0
    slot = slots.slot_of(result.blamed)
    aside = len(slots.set_aside)
    if slot in slots.rejoining and not progress.made:  # A trial: no restart used.
        slots.lose(slot, epochs_done)
        return after.start(f"slot {slot} failed again on rejoining, so it is lost"
                           + _set_aside(slots, aside)
                           + lines.next_try(slots.next_try_epochs, after.folder)
                           + f"; going on with {lines.workers(len(slots.running))} of "
                           f"{slots.maximum}")
    after.failures += 1
    if after.failures <= max_restarts:
        return after.start(f"restart {after.failures} of {max_restarts}: starting every worker "
                           "again" + _rejoining(slots))
    if not slots.can_lose(slot):
        return after.exit(result.status,
                          lines.end_line(slots, slot, max_restarts, result.status))
    count = len(slots.running)
    slots.lose(slot, epochs_done)
    after.failures = 0
    return after.start(f"the restarts at {lines.workers(count)} are used up ({max_restarts} of "
                       f"{max_restarts}): slot {slot} is lost" + _set_aside(slots, aside)
                       + lines.next_try(slots.next_try_epochs, after.folder)
                       + f"; going on with {lines.workers(len(slots.running))} of "
                       f"{slots.maximum} (at least {slots.minimum}) at the same global batch")


def growth_due(progress: Progress, slots: elastic.WorkerSlots) -> str | None:
    """Whether a shrunk job should grow now: it has reached the epoch boundary at which its lost
    slots are tried again (an epoch saved during this round, at or past the slots' next try).

    Args:
        progress: The round's progress so far, as its chief recorded it.
        slots: The job's slots.

    Returns:
        That boundary in words (``"epoch 3 is saved"``), or ``None``: not now.
    """
    if not slots.lost or progress.before is None or progress.after is None:
        return None
    epochs = progress.after[0]
    if epochs > progress.before[0] and epochs >= slots.next_try_epochs:
        return f"epoch {epochs} is saved"
    return None


def _rejoining(slots: elastic.WorkerSlots) -> str:
    """Puts lost slots back for the next round (of this decision's copy); their words."""
    back = slots.rejoin()
    return (f" with {lines.workers(len(slots.running))}, slot {lines.listed(back)} rejoining"
            if back else "")


def notice_status(statuses: list[int], started: bool = False) -> int:
    """The job's status after a notice to the launcher, from the workers' normalised statuses:
    the preempted status when every worker saved (or finished, or, before training began, the
    notice ended it while it was starting), the worst other one where a worker did neither
    (killed past the grace, killed by the notice during training, crashed), 0 only when every
    worker finished.

    Args:
        statuses: Each worker's normalised status.
        started: Whether training had begun in the round (its chief recorded progress): a
            worker the notice's SIGTERM ended then was killed without saving.
    """
    excused = (ExitStatus.SUCCESS, ExitStatus.PREEMPTED,
               *(() if started else (lines.ENDED_BY_THE_NOTICE,)))
    others = [s for s in statuses if s not in excused]
    if others:
        return max(others)
    if any(s != ExitStatus.SUCCESS for s in statuses):
        return int(ExitStatus.PREEMPTED)
    return int(ExitStatus.SUCCESS)
