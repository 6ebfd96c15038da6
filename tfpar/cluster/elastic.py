"""An elastic job's worker slots: how many workers it may run, which slots run, which were lost.

A job launched with ``num_workers=MIN:MAX`` (torchrun's ``--nnodes=MIN:MAX``) has MAX *slots*;
each worker is started in one and keeps its slot across restarts (``TFPAR_WORKER_SLOT`` in its
environment), while its rank (its ``TF_CONFIG`` index) is its place among the slots running now.
A slot that keeps failing (more than the job's restarts at its current size) is *lost*: the job
goes on with the others, down to MIN, from the last saved state at the same global batch. A lost
slot is tried again (*rejoins*) at the job's next restart, or at an epoch boundary, the first
one epoch after it was lost, then after 2, 4, ... epochs while it keeps failing on rejoining; a
rejoining slot that fails before the job saves anything new is lost again at once, without
using a restart.

No TensorFlow here: the launcher keeps its bookkeeping in a :class:`WorkerSlots`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfpar.errors import ConfigError


def parse_worker_range(text: str | int) -> tuple[int, int]:
    """Reads a number of workers, ``"N"`` or ``"MIN:MAX"`` (torchrun's spelling).

    Returns:
        ``(minimum, maximum)``; equal for a fixed number.

    Raises:
        ConfigError: Unless 1 <= MIN <= MAX, both integers (the message names ``num_workers``).
    """
    parts = str(text).strip().split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2 or not 1 <= numbers[0] <= numbers[1]:
        raise ConfigError("{argument} is a number of workers N or a range MIN:MAX with "
                          f"1 <= MIN <= MAX, e.g. 4 or 3:4. Received: {text!r}.",
                          argument="num_workers")
    return numbers[0], numbers[1]


def worker_words(rank: int, slots: Sequence[int]) -> str:
    """A worker in words: ``worker 2``, or ``worker 2 (slot 3)`` when its rank among ``slots``
    (the slots running, in rank order) and its slot differ."""
    slot = slots[rank]
    return f"worker {rank}" if slot == rank else f"worker {rank} (slot {slot})"


@dataclasses.dataclass
class WorkerSlots:
    """Which of an elastic job's slots run, and what happens when one fails.

    Attributes:
        minimum: The fewest workers the job runs with.
        maximum: The number of slots (the most workers).
        running: The slots of the next (or current) start, in rank order.
        lost: The slots lost, in the order lost.
        rejoining: Slots of the current start that were lost before (on trial until the job
            saves something new).
        next_try_epochs: The number of finished epochs at which lost slots are tried again.
        sizes: The numbers of workers the job may run with (``None``: any from ``minimum``
            to ``maximum``); a world-size-invariant job runs only where its shards divide
            evenly. A lost slot that leaves another number sets aside the highest slots
            running too, until the job's size is one of these.
        set_aside: The slots of :attr:`lost` set aside that way (not failed themselves).
    """

    minimum: int
    maximum: int
    running: list[int] = dataclasses.field(default_factory=list)
    lost: list[int] = dataclasses.field(default_factory=list)
    rejoining: list[int] = dataclasses.field(default_factory=list)
    next_try_epochs: int = 0
    sizes: tuple[int, ...] | None = None
    set_aside: list[int] = dataclasses.field(default_factory=list)
    _interval: int = dataclasses.field(default=1, init=False, repr=False)

    def __post_init__(self):
        if not self.running and not self.lost:
            self.running = list(range(self.maximum))

    @property
    def elastic(self) -> bool:
        """Whether the job may run with fewer workers than it has slots."""
        return self.minimum < self.maximum

    def slot_of(self, rank: int) -> int:
        """The slot of the worker of rank ``rank`` in the current start."""
        return self.running[rank]

    def _size_without(self, slot: int) -> int | None:
        """The job's size once ``slot`` is lost (and slots set aside, where needed); ``None``
        where no size it may run with is left."""
        left = len([s for s in self.running if s != slot])
        allowed = [n for n in (self.sizes or range(self.minimum, self.maximum + 1))
                   if self.minimum <= n <= left]
        return max(allowed) if allowed else None

    def can_lose(self, slot: int) -> bool:
        """Whether the job keeps at least ``minimum`` workers without ``slot`` (and a number
        it may run with)."""
        return self.elastic and self._size_without(slot) is not None

    def lose(self, slot: int, epochs_done: int) -> None:
        """Takes ``slot`` out of the job (see :meth:`can_lose`); lost slots are tried again
        once the job has finished epochs beyond ``epochs_done`` (further each time a slot fails
        on rejoining)."""
        if slot in self.rejoining:
            self._interval *= 2
        else:
            self._interval = 1
        size = self._size_without(slot)
        self.running = [s for s in self.running if s != slot]
        self.rejoining = [s for s in self.rejoining if s != slot]
        self.lost.append(slot)
        while size is not None and len(self.running) > size:
            aside = self.running.pop()
            self.rejoining = [s for s in self.rejoining if s != aside]
            self.lost.append(aside)
            self.set_aside.append(aside)
        self.next_try_epochs = epochs_done + self._interval

    def fit_sizes(self) -> list[int] | None:
        """Sets aside the highest slots running until the job's size is one of :attr:`sizes`
        (learned after it shrank to another); returns them, or ``None`` where no size it may
        run with is left (nothing changes)."""
        allowed = [n for n in (self.sizes or ()) if self.minimum <= n <= len(self.running)]
        if not allowed:
            return None
        aside = []
        while len(self.running) > max(allowed):
            aside.append(self.running.pop())
        self.rejoining = [s for s in self.rejoining if s not in aside]
        self.lost += aside
        self.set_aside += aside
        return aside

    def rejoin(self) -> list[int]:
        """Puts every lost slot back for the next start, on trial; returns them."""
        back = sorted(self.lost)
        self.running = sorted(self.running + back)
        self.rejoining = [s for s in back if s not in self.set_aside]
        self.lost, self.set_aside = [], []
        return back

    def settled(self) -> None:
        """The job saved something new: rejoined slots are no longer on trial."""
        self.rejoining = []
        self._interval = 1
