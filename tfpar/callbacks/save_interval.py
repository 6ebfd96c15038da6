"""What saving inside an epoch costs, and how to make it cheapest: the way a save is written
(within the step, or in the background) and the automatic interval, the most frequent whose
cost stays within a budget of the training time, both from the steps and saves timed on this
run (CheckFreq's rule, FAST'21).

A save every ``N`` steps costs ``save / (N * step)`` of the training time, so the interval is
the smallest ``N`` for which that is at most the budget. :class:`IntervalChooser` times the
steps of a run (not an epoch's first call, which follows its evaluation and save, nor the
saves) and every save, and chooses from their medians, first after :data:`SAVES_TIMED` saves
(the first is the slowest: it builds what later saves reuse). A save written within the step costs
its time. One written in the background costs the time it holds the step, plus, where the
write runs on the cores the step runs on (training on the CPU), what the steps beside it took
longer (measured, as it depends on how fully the step uses the cores), which chooses the way;
the interval's budget counts at least the write's whole time there (see
:attr:`IntervalChooser.save_seconds`). Beside an accelerator's step a write costs nothing more.
No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from tfpar.errors import ConfigError

AUTO = "auto"
"""``save_every_steps``'s value that asks for the interval to be chosen."""
BUDGET = 0.02
"""The default budget: saving costs at most 2% of the training time."""
LEAST_BUDGET = 0.0001
"""The smallest budget (0.01%): below it an interval would be longer than any run."""
CALLS_TIMED = 1
"""Calls of the training step timed before each save timed for the interval's first choice,
since the run's start or the save before (one step each, or ``steps_per_execution``): one, so
that the saves come inside the first epochs even where an epoch is a few calls."""
SAVES_TIMED = 3
"""Saves timed before the interval is chosen: the first, written within the step (the
slowest: it builds what later saves reuse, so a choice from it alone would save far less often
than the budget allows), and two more, so that each way a later save may be written is timed
after it."""


def checked_interval(value: Any, argument: str = "save_every_steps") -> int | str:
    """``value`` as an interval: an integer >= 0 (a string of ASCII digits, as a flag gives
    it, converted) or :data:`AUTO`.

    Raises:
        ConfigError: Naming ``argument``, for anything else.
    """
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value):
        value = int(value)
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0:
        return int(value)
    raise ConfigError(f"{{argument}} must be an integer >= 0 (0: at epochs' ends only) or "
                      f"{AUTO!r}. Received: {{argument}}={value!r}.", argument=argument)


def checked_budget(value: Any, argument: str = "save_budget") -> float:
    """``value`` as a budget: a fraction of the training time from :data:`LEAST_BUDGET` to
    below 1.

    Raises:
        ConfigError: Naming ``argument``, for anything else.
    """
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and LEAST_BUDGET <= float(value) < 1):
        return float(value)
    raise ConfigError(f"{{argument}} must be a fraction of the training time from "
                      f"{LEAST_BUDGET} to below 1 (0.02: 2%). Received: {{argument}}={value!r}.",
                      argument=argument)


def checked_write_mode(value: Any, argument: str = "write_in_background") -> bool | None:
    """``value`` as a way of writing saves: ``True`` (in the background), ``False`` (within
    the step) or ``None`` for :data:`AUTO` (the cheaper, chosen from the saves timed).

    Raises:
        ConfigError: Naming ``argument``, for anything else.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value == AUTO:
        return None
    raise ConfigError(f"{{argument}} must be True (in the background), False (within the "
                      f"step) or {AUTO!r} (the cheaper, timed on this run). Received: "
                      f"{{argument}}={value!r}.", argument=argument)


def within_budget(step_seconds: float, save_seconds: float, budget: float) -> int:
    """The most frequent interval, in steps, whose saves cost at most ``budget`` of the time.

    Args:
        step_seconds: The time of a step (> 0).
        save_seconds: The time of a save (>= 0).
        budget: The largest fraction of the training time saving may take (> 0).

    Returns:
        The smallest ``N >= 1`` with ``save_seconds <= budget * N * step_seconds``.
    """
    if save_seconds <= 0:
        return 1
    if step_seconds <= 0:
        return math.ceil(1 / budget)  # A step too short to time: as if it took the save's time.
    # The small tolerance keeps an exact ratio (save = budget * 3 steps) at 3, not 4.
    return max(1, math.ceil(save_seconds / (budget * step_seconds) - 1e-9))


def percent(fraction: float) -> str:
    """``fraction`` as a percentage of three significant digits (``2%``, ``0.01%``)."""
    return f"{fraction * 100:.3g}%"


def describe(interval: int, step_seconds: float, save_seconds: float, budget: float,
             epoch_steps: int | None = None, how: str | None = None,
             here: int | None = None, chosen: int | None = None) -> str:
    """The interval chosen and why, in one line (saving at epochs' ends only where the
    interval is an epoch or longer).

    Args:
        interval: The interval the run saves at.
        step_seconds: This process's median step.
        save_seconds: This process's median save cost.
        budget: The budget.
        epoch_steps: The steps of an epoch, where known (``None``: the line says it is not).
        how: What a save costs and how it is written, in words (:attr:`IntervalChooser.how`);
            ``None``: "a save took ``save_seconds``".
        here: This process's interval, where the job saves at another worker's longer one.
        chosen: What this process's times gave, where ``here`` is that rounded up to whole
            calls of several steps.
    """
    times = f"{how or f'a save took {save_seconds:.3g} s'} and a step {step_seconds:.3g} s"
    longer = ""
    if chosen is not None and here is not None and here != chosen:
        longer = f" (rounded up from {chosen} to whole calls of the step)"
    if here is not None and here != interval:
        longer = f" (the longest of the job's workers' intervals; {here} here)"
    if epoch_steps and interval >= epoch_steps:
        return (f"Saving at epochs' ends only: {times}, so the most frequent saves within the "
                f"budget of {percent(budget)} of the training time come every {interval} "
                f"steps{longer}, and an epoch has {epoch_steps}.")
    cost = save_seconds / (interval * step_seconds) if step_seconds > 0 else 0.0
    unknown = ("" if epoch_steps else " The data does not say how many steps an epoch has: an "
               "epoch of fewer is saved at its end only.")
    return (f"Saving every {interval} step(s) inside an epoch{longer}: {times}, so these saves "
            f"cost {percent(cost)} of the training time (budget {percent(budget)}).{unknown}")


@dataclasses.dataclass
class _Slowed:
    """The calls of the step that ran beside one save's write in the background: their
    seconds and steps, and whether they are all timed (a later save, or a call that ended with
    no write in flight, closes them)."""

    calls: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    closed: bool = False
    waited: float = 0.0  # What the next save waited for the write, holding the step.


class IntervalChooser:
    """Times a run's steps and saves: chooses how to write a save (within the step, or in the
    background) and the interval, from their medians.

    A save written within the step costs the time it holds the step. One written in the
    background costs the time it holds the step (the copy to host memory), plus, where the
    write runs on the cores the step runs on (training on the CPU), what the steps beside the
    write took longer than the others: measured, not assumed, since how much of the cores a
    write takes depends on how fully the step uses them (on one device of two cores a write
    took more than it saved; on two devices it saved a third of a save's cost). The first save
    is written within the step (its whole time is then known before the first choice); where
    the way of writing is chosen, the next one in the background, and from then on each save is
    written the way whose median cost is lower.

    Args:
        budget: The largest fraction of the training time saving may take.
        clock: Seconds, monotonic (``None``: ``time.perf_counter``).
        writes_share_cores: Whether a save's write in the background runs on the cores the
            step runs on (training on the CPU): the steps it slows then count as its cost.
        in_background: ``None``: choose how to write, from the costs timed; ``True``: every
            save after the first in the background; ``False``: every save within the step.
    """

    def __init__(self, budget: float = BUDGET, clock: Callable[[], float] | None = None,
                 writes_share_cores: bool = False, in_background: bool | None = True):
        self.budget, self._clock = budget, clock or time.perf_counter
        self.writes_share_cores = writes_share_cores
        self._in_background = in_background
        self._step_seconds: list[float] = []
        self._within_seconds: list[float] = []  # Saves written within the step.
        self._held_seconds: list[float] = []  # The step held by saves written in background.
        self._write_seconds: list[float] = []
        self._slowed: list[_Slowed] = []  # Per save written in the background.
        # (time, steps) at the last call's end, and whether a write was in flight then.
        self._last: tuple[float, int, bool] | None = None
        self._calls = 0
        self._calls_at_save = 0  # The calls timed when the last save was.
        self._saves = 0
        self._said: bool | None = None  # The way of writing last said (see :meth:`changed`).

    def step_ended(self, steps: int, writing: bool = False) -> None:
        """Notes that the epoch's step count reached ``steps``: the time since the last call
        is that many steps more (their mean, for several steps per call); a count that did not
        grow (a new epoch) starts the timing afresh.

        Args:
            steps: The epoch's steps done.
            writing: Whether a save's write is in flight in the background now.
        """
        now = self._clock()
        if self._last is not None and steps > self._last[1]:
            seconds, count = now - self._last[0], steps - self._last[1]
            if self._last[2] and self._slowed:  # This call ran beside a write.
                self._slowed[-1].calls.append((seconds, count))
            else:
                self._step_seconds.append(seconds / count)
            self._calls += 1
        if not writing and self._slowed:
            self._slowed[-1].closed = True
        self._last = (now, steps, writing)

    def epoch_ended(self) -> None:
        """Notes an epoch's end: what follows until the next epoch's first call (evaluation,
        a save) is not a step."""
        self._last = None

    @property
    def ready(self) -> bool:
        """Whether enough calls were timed since the run's start, or the last save, for a save
        timed before the interval is chosen."""
        return self._calls - self._calls_at_save >= CALLS_TIMED

    @property
    def step_seconds(self) -> float:
        """The median step beside no write (0 before any)."""
        return statistics.median(self._step_seconds) if self._step_seconds else 0.0

    @property
    def held_seconds(self) -> float:
        """The median time a save written in the background held the step (0 before any)."""
        return statistics.median(self._held_seconds) if self._held_seconds else 0.0

    @property
    def write_seconds(self) -> float:
        """The median time of a write in the background (0 before any)."""
        return statistics.median(self._write_seconds) if self._write_seconds else 0.0

    @property
    def within_seconds(self) -> float | None:
        """The median cost of a save written within the step, the first (which also builds
        what later saves reuse) left out once there are others (``None`` before any)."""
        timed = self._within_seconds[1:] or self._within_seconds
        return statistics.median(timed) if timed else None

    @property
    def slowed_seconds(self) -> float | None:
        """The median of what the steps beside a write in the background took longer than
        the steps beside none, and what the next save waited for the write to end, of the
        writes beside which steps were timed (``None`` before one; where writes do not share
        the step's cores, only the wait). A write at an epoch's end runs beside the evaluation
        and the next epoch's first call, which are not timed (what a save at that call waited
        for it counts)."""
        if not self.writes_share_cores:  # Only what a save waited for the write before it.
            waited = [each.waited for each in self._slowed if each.closed]
            return (statistics.median(waited) if waited else 0.0) if self._held_seconds else None
        step = self.step_seconds
        slowed = [sum(seconds - count * step for seconds, count in each.calls) + each.waited
                  for each in self._slowed if each.closed and (each.calls or each.waited)]
        return max(0.0, statistics.median(slowed)) if slowed and step > 0 else None

    @property
    def background_seconds(self) -> float | None:
        """The median cost of a save written in the background (``None`` until known): the
        time it held the step plus the slowed steps beside its write, or, where none were
        timed beside one (saves at epochs' ends only), its write's whole time."""
        slowed = self.slowed_seconds
        if slowed is None and self.writes_share_cores and self._write_seconds:
            slowed = self.write_seconds
        return None if slowed is None else self.held_seconds + slowed

    def next_in_background(self) -> bool:
        """Whether the next save is to be written in the background."""
        if self._in_background is False or not self._within_seconds:
            return False  # The first save is written within the step: its whole time known.
        if self._in_background or not self._held_seconds:
            return True
        if len(self._within_seconds) < 2:
            return False  # A save within the step after the first, which is the slowest.
        background = self.background_seconds
        return background is None or background <= (self.within_seconds or 0.0)

    @property
    def save_seconds(self) -> float:
        """What a save the way the next one is written costs the training time, for the
        interval's budget (0 before any): within the step, its median time; in the background,
        the time it held the step, plus, where the write shares the step's cores, the longer of
        the write's time and what the steps beside it slowed: counting only the slowed steps,
        the saving benchmark's automatic interval cost more than its budget over whole epochs
        on the CPU."""
        background, within = self.background_seconds, self.within_seconds
        if self.next_in_background() and background is not None:
            if not self.writes_share_cores:
                return background
            return self.held_seconds + max(self.slowed_seconds or 0.0, self.write_seconds)
        return within if within is not None else (background or 0.0)

    @property
    def how(self) -> str | None:
        """What a save costs and how it is written, in words (``None`` before a save)."""
        background, within = self.background_seconds, self.within_seconds
        if not self.next_in_background() or background is None:
            if within is None:
                return None
            other = ("" if background is None else
                     f" (in the background it cost {background:.3g} s)")
            return f"a save written within the step took {within:.3g} s{other}"
        if not self.writes_share_cores:
            other = "" if within is None else f" (within the step: {within:.3g} s)"
            return (f"a save written in the background held the step {self.held_seconds:.3g} "
                    f"s, its write running beside the step{other}")
        other = "" if within is None else f"; within the step a save took {within:.3g} s"
        slowed = self.slowed_seconds
        beside = ("no step was timed beside it" if slowed is None
                  else f"the steps beside it slowed by {slowed:.3g} s")
        return (f"a save written in the background held the step {self.held_seconds:.3g} s and "
                f"its write took {self.write_seconds:.3g} s on the cores the step runs on "
                f"({beside}{other})")

    def changed(self) -> bool:
        """Whether the way of writing (chosen from both ways' costs) differs from when this was
        last asked: the first time both are known, or when their costs changed places."""
        if self._in_background is not None or not self.timed or (
                self.background_seconds is None or self.within_seconds is None):
            return False  # Until the saves timed to choose from are made, none is chosen.
        now = self.next_in_background()
        changed, self._said = now != self._said, now
        return changed

    def timed_write(self, seconds: float) -> None:
        """Notes that a save's write in the background took ``seconds``."""
        self._write_seconds.append(seconds)

    @property
    def timed(self) -> bool:
        """Whether the saves to choose from were timed (:data:`SAVES_TIMED`): counted, not
        timed, so that every worker of a job, each with its own clock, chooses at the same
        save."""
        return self._saves >= SAVES_TIMED

    def timed_save(self, save: Callable[[], bool],
                   wait: Callable[[], None] | None = None) -> None:
        """Runs ``save``, timing it; the next step's time starts after it.

        Args:
            save: Saves; returns whether the save's write goes on in the background.
            wait: Waits for the write in the background before (if any) to end: timed apart,
                as a cost of that write (the step waits), not of this save.
        """
        start = self._clock()
        if wait is not None:
            wait()
            now = self._clock()
            waited, start = now - start, now
            if self._slowed and not self._slowed[-1].closed:
                self._slowed[-1].waited += waited
        if self._slowed:
            self._slowed[-1].closed = True  # The steps beside the write before are timed.
        background = save()
        end = self._clock()
        self._saves += 1
        self._calls_at_save = self._calls
        if background:
            self._held_seconds.append(end - start)
            self._slowed.append(_Slowed())
        else:
            self._within_seconds.append(end - start)
        if self._last is not None:
            self._last = (end, self._last[1], bool(background))

    def choose(self) -> int:
        """The interval for the medians of the steps and saves timed."""
        return within_budget(self.step_seconds, self.save_seconds, self.budget)
