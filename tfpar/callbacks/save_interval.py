"""The automatic interval of saves inside an epoch: the most frequent whose cost stays within
a budget of the training time, from a step and a save measured on this run (CheckFreq's rule,
FAST'21).

A save every ``N`` steps costs ``save / (N * step)`` of the training time, so the interval is
the smallest ``N`` for which that is at most the budget. :class:`IntervalChooser` times the
steps of a run (not the first, which traces the step, nor the saves) and one save, and then
chooses. No TensorFlow.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

AUTO = "auto"
"""``save_every_steps``'s value that asks for the interval to be chosen."""
BUDGET = 0.02
"""The default budget: saving costs at most 2% of the training time."""
STEPS_TIMED = 3
"""Steps timed before the interval is chosen (after the first step of a run)."""


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
    # The small tolerance keeps an exact ratio (save = budget * 3 steps) at 3, not 4.
    return max(1, math.ceil(save_seconds / (budget * step_seconds) - 1e-9))


def describe(interval: int, step_seconds: float, save_seconds: float, budget: float) -> str:
    """The interval chosen and why, in one line."""
    cost = save_seconds / (interval * step_seconds)
    return (f"Saving every {interval} step(s) inside an epoch: a save took {save_seconds:.3g} s "
            f"and a step {step_seconds:.3g} s, so saving costs {cost:.1%} of the training "
            f"time (budget {budget:.1%}).")


class IntervalChooser:
    """Times a run's steps, then one save, and chooses the interval.

    Args:
        budget: The largest fraction of the training time saving may take.
        clock: Seconds, monotonic (``None``: ``time.perf_counter``).
    """

    def __init__(self, budget: float = BUDGET, clock: Callable[[], float] | None = None):
        self.budget, self._clock = budget, clock or time.perf_counter
        self._step_seconds: list[float] = []
        self._last: tuple[float, int] | None = None  # (time, steps) at the last batch end.
        self.step_seconds = 0.0
        self.save_seconds = 0.0

    def step_ended(self, steps: int) -> None:
        """Notes that the epoch's step count reached ``steps``: the time since the last call
        is that many steps more (their mean, for several steps per call); a count that did not
        grow (a new epoch) starts the timing afresh."""
        now = self._clock()
        if self._last is not None and steps > self._last[1]:
            self._step_seconds.append((now - self._last[0]) / (steps - self._last[1]))
        self._last = (now, steps)

    @property
    def ready(self) -> bool:
        """Whether enough steps were timed to choose at a save."""
        return len(self._step_seconds) >= STEPS_TIMED

    def timed_save(self, save: Callable[[], object]) -> None:
        """Runs ``save``, timing it; the next step's time starts after it."""
        start = self._clock()
        save()
        end = self._clock()
        self.save_seconds = end - start
        if self._last is not None:
            self._last = (end, self._last[1])

    def choose(self) -> int:
        """The interval for the steps and the save timed (the steps' median)."""
        self.step_seconds = statistics.median(self._step_seconds)
        return within_budget(self.step_seconds, self.save_seconds, self.budget)
