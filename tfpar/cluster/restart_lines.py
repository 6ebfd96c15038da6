"""The launcher's lines after a round of workers, in words: where the job resumes, what was lost,
why it ends. Pure formatting of facts :mod:`.restart_policy` decided on (no decision here), so
the words can change without touching a rule, and a rule's test reads the line it gives.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from tfpar.cluster import elastic
from tfpar.errors import SIGNALLED
from tfpar.errors import ExitStatus
from tfpar.worker_contract import position_words

#: A position saved, ``(epochs, steps)``; ``None`` where none is known.
Position = tuple[int, int] | None

ENDED_BY_THE_NOTICE = SIGNALLED + signal.SIGTERM
"""A worker the notice itself ended before it watched for notices (still starting): it had
nothing new to save, and the state saved before is intact. Once training began (the chief
recorded progress), the same status is a worker killed by the notice without saving."""
KILLED_PAST_GRACE = SIGNALLED + signal.SIGKILL
"""A worker killed after the grace budget."""


def workers(count: int) -> str:
    """``count`` workers, in words."""
    return f"{count} worker{'s' * (count != 1)}"


def listed(slots: Sequence[int]) -> str:
    """Slot numbers, comma-separated."""
    return ", ".join(map(str, slots))


def start_line(which: str, after: Position, folder: str | None,
               resumes_itself: bool = False) -> str:
    """The line of a new round: what starts (``which``), and where it resumes (``folder``:
    the one the chief declared; ``None`` where none was, and then the command resumes by itself
    if ``resumes_itself``, else it starts from scratch)."""
    if folder is None:
        return (f"launcher: {which}; the command resumes by itself." if resumes_itself else
                f"launcher: {which}, from scratch (no folder of saved state declared yet).")
    if after is None:
        return f"launcher: {which}, resuming from what {folder} holds."
    if after != (0, 0):
        return f"launcher: {which}, resuming from {position_words(after)} in {folder}."
    return f"launcher: {which}, from scratch (no epoch saved in {folder} yet)."


def who(rank: int, slots: elastic.WorkerSlots) -> str:
    """The worker of ``rank`` (and its slot, where they differ), in words."""
    return elastic.worker_words(rank, slots.running)


def where(after: Position, folder: str | None) -> str:
    """Where the folder resumes, in words (empty where unknown, or nothing is saved)."""
    if after is None or after == (0, 0) or folder is None:
        return ""
    return f"{position_words(after)} in {folder}"


def lost_since(after: Position, folder: str | None) -> str:
    """Where a rerun resumes and that the training since is lost, in words."""
    resumes = where(after, folder)
    if resumes:
        return f"a rerun resumes at {resumes}, and the training since is lost"
    if after == (0, 0) and folder is not None:
        return f"nothing was saved in {folder} yet, so a rerun starts from scratch"
    return "the training since the last complete state is lost"


def losers(ranks: Sequence[int], slots: elastic.WorkerSlots) -> str:
    """The workers whose save ran out of grace, in words."""
    return " and ".join(who(rank, slots) for rank in ranks)


def lost_notice_line(losing: str, after: Position, folder: str | None) -> str:
    """The last line after a worker's own notice whose save ran out of grace (``losing``: the
    workers, in words)."""
    return (f"launcher: preempted; {losing} could not save the notice's state within the grace "
            f"budget: {lost_since(after, folder)}.")


def saved_notice_line(status: int, statuses: Sequence[int], after: Position,
                      folder: str | None, slots: elastic.WorkerSlots) -> str:
    """The last line after a worker's own notice, not restarted: the status, where the folder
    resumes, and any other worker that ended otherwise than saving or finishing."""
    resumes = where(after, folder)
    others = [f"{who(rank, slots)} exited with {s}" for rank, s in enumerate(statuses)
              if s not in (ExitStatus.SUCCESS, ExitStatus.PREEMPTED)]
    return (f"launcher: preempted; exiting with {status}"
            + (f", the state saved at {resumes}" if resumes else "")
            + (f" ({', '.join(others)})" if others else "") + ".")


def notice_line(status: int, statuses: Sequence[int], work_lost: bool, workers_ran: bool,
                after: Position, folder: str | None, slots: elastic.WorkerSlots) -> str:
    """The last line after a notice to the launcher, ending it with ``status``: the workers'
    real statuses (``statuses``) and where the folder resumes."""
    resumes, lost = where(after, folder), lost_since(after, folder)
    if work_lost:
        return (f"launcher: preempted; the workers exited with {status}, but the notice's "
                f"state could not be saved within the grace budget: {lost}.")
    if status not in (ExitStatus.SUCCESS, ExitStatus.PREEMPTED):
        why = {KILLED_PAST_GRACE: "killed past the grace budget",
               ENDED_BY_THE_NOTICE: "ended by the notice's SIGTERM without saving: the "
                                    "command does not save on a notice"}.get(status)
        return (f"launcher: preempted; the workers exited with {status}"
                + (f" ({why})" if why else "") + f": {lost}.")
    saved = f", the state saved at {resumes}" if resumes else ""
    if not workers_ran:  # Taken between rounds (or before the first).
        return f"launcher: preempted; exiting with {status}{saved}: no worker was running."
    starting = [rank for rank, s in enumerate(statuses) if s == ENDED_BY_THE_NOTICE]
    if not starting:
        return f"launcher: preempted; the workers exited with {status}{saved}."
    they = "they" if len(starting) > 1 else "it"
    return (f"launcher: preempted; exiting with {status}{saved}: {losers(starting, slots)} "
            f"{'were' if len(starting) > 1 else 'was'} ended by the notice while starting (exit "
            f"{ENDED_BY_THE_NOTICE}), before {they} watched for notices, with nothing to "
            "save.")


def set_aside_words(new: Sequence[int], sizes: Sequence[int]) -> str:
    """The slots a loss set aside beyond the failed one (``new``), in words (none: empty)."""
    if not new:
        return ""
    allowed = " or ".join(str(n) for n in sorted(sizes, reverse=True))
    return f" and slot {listed(new)} set aside with it (the job runs with {allowed} workers)"


def next_try(next_try_epochs: int, folder: str | None) -> str:
    """When a lost slot is tried again, in words."""
    return (f" (tried again after epoch {next_try_epochs} or at a restart)"
            if folder is not None else " (tried again at a restart)")


def end_line(slots: elastic.WorkerSlots, slot: int, max_restarts: int, status: int) -> str:
    """The last line when the restarts are used up and ``slot`` cannot be lost."""
    used = f"({max_restarts} of {max_restarts})"
    if not slots.elastic:
        return (f"launcher: restarts used up {used}; exiting with the failed worker's status "
                f"({status}).")
    return (f"launcher: the restarts at {workers(len(slots.running))} are used up {used} and "
            f"without slot {slot} {workers(len(slots.running) - 1)} would be left, fewer than "
            f"the minimum of {slots.minimum}; exiting with the failed worker's status "
            f"({status}).")
