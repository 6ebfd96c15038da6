"""The automatic interval of saves inside an epoch: the most frequent whose cost stays within
a budget of the training time, from the steps and saves timed on this run (CheckFreq's rule,
FAST'21).

A save every ``N`` steps costs ``save / (N * step)`` of the training time, so the interval is
the smallest ``N`` for which that is at most the budget. :class:`IntervalChooser` times the
steps of a run (not an epoch's first call, which follows its evaluation and save, nor the
saves) and every save, and chooses from their medians (a process's first save is its slowest).
A save written in the background costs the time it holds the step, plus, where the write runs
on the cores the step runs on (training on the CPU), the write's time: there it takes those
cores from the step; beside an accelerator's step it costs nothing more. No TensorFlow.
"""

from __future__ import annotations

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
CALLS_TIMED = 3
"""Calls of the training step timed before the first save inside an epoch (one step each,
or ``steps_per_execution``)."""


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
             epoch_steps: int | None = None,
             background: tuple[float, float, bool] | None = None,
             here: int | None = None, chosen: int | None = None) -> str:
    """The interval chosen and why, in one line (saving at epochs' ends only where the
    interval is an epoch or longer).

    Args:
        interval: The interval the run saves at.
        step_seconds: This process's median step.
        save_seconds: This process's median save cost.
        budget: The budget.
        epoch_steps: The steps of an epoch, where known.
        background: The seconds a save held the step and its write took in the background,
            and whether the write shares the step's cores (then ``save_seconds`` is their sum).
        here: This process's interval, where the job saves at another worker's longer one.
        chosen: What this process's times gave, where ``here`` is that rounded up to whole
            calls of several steps.
    """
    times = f"a save took {save_seconds:.3g} s and a step {step_seconds:.3g} s"
    if background is not None:
        held, write, shared = background
        times = (f"a save held the step {held:.3g} s and was written in {write:.3g} s "
                 f"{'on the cores the step runs on' if shared else 'beside the step'}, and a "
                 f"step took {step_seconds:.3g} s")
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
    return (f"Saving every {interval} step(s) inside an epoch{longer}: {times}, so these saves "
            f"cost {percent(cost)} of the training time (budget {percent(budget)}).")


class IntervalChooser:
    """Times a run's steps and saves, and chooses the interval from their medians.

    Args:
        budget: The largest fraction of the training time saving may take.
        clock: Seconds, monotonic (``None``: ``time.perf_counter``).
        writes_share_cores: Whether a save's write in the background runs on the cores the
            step runs on (training on the CPU): its time then counts as the save's cost.
    """

    def __init__(self, budget: float = BUDGET, clock: Callable[[], float] | None = None,
                 writes_share_cores: bool = False):
        self.budget, self._clock = budget, clock or time.perf_counter
        self.writes_share_cores = writes_share_cores
        self._step_seconds: list[float] = []
        self._save_seconds: list[float] = []
        self._write_seconds: list[float] = []
        self._last: tuple[float, int] | None = None  # (time, steps) at the last call's end.
        self._calls = 0

    def step_ended(self, steps: int) -> None:
        """Notes that the epoch's step count reached ``steps``: the time since the last call
        is that many steps more (their mean, for several steps per call); a count that did not
        grow (a new epoch) starts the timing afresh."""
        now = self._clock()
        if self._last is not None and steps > self._last[1]:
            self._step_seconds.append((now - self._last[0]) / (steps - self._last[1]))
            self._calls += 1
        self._last = (now, steps)

    def epoch_ended(self) -> None:
        """Notes an epoch's end: what follows until the next epoch's first call (evaluation,
        a save) is not a step."""
        self._last = None

    @property
    def ready(self) -> bool:
        """Whether enough calls were timed to save and choose inside an epoch."""
        return self._calls >= CALLS_TIMED

    @property
    def step_seconds(self) -> float:
        """The median step time (0 before any)."""
        return statistics.median(self._step_seconds) if self._step_seconds else 0.0

    @property
    def held_seconds(self) -> float:
        """The median time a save held the step (0 before any)."""
        return statistics.median(self._save_seconds) if self._save_seconds else 0.0

    @property
    def write_seconds(self) -> float:
        """The median time of a write in the background (0 before any)."""
        return statistics.median(self._write_seconds) if self._write_seconds else 0.0

    @property
    def save_seconds(self) -> float:
        """The median cost of a save: the time it held the step, plus its write's where that
        shares the step's cores."""
        return self.held_seconds + (self.write_seconds if self.writes_share_cores else 0.0)

    @property
    def background(self) -> tuple[float, float, bool] | None:
        """For :func:`describe`: the held and write times and whether writes share the step's
        cores, once a write in the background was timed (``None`` before)."""
        if not self._write_seconds:
            return None
        return self.held_seconds, self.write_seconds, self.writes_share_cores

    def timed_write(self, seconds: float) -> None:
        """Notes that a save's write in the background took ``seconds``."""
        self._write_seconds.append(seconds)

    @property
    def timed(self) -> bool:
        """Whether a step and a save were timed."""
        return bool(self._step_seconds and self._save_seconds)

    def timed_save(self, save: Callable[[], object]) -> None:
        """Runs ``save``, timing it; the next step's time starts after it."""
        start = self._clock()
        save()
        end = self._clock()
        self._save_seconds.append(end - start)
        if self._last is not None:
            self._last = (end, self._last[1])

    def choose(self) -> int:
        """The interval for the medians of the steps and saves timed."""
        return within_budget(self.step_seconds, self.save_seconds, self.budget)
