"""Tests of the automatic interval of saves inside an epoch: the rule, and its measurement."""

import itertools
import unittest
from collections.abc import Callable

import numpy as np

from tfpar.callbacks import save_interval
from tfpar.errors import ConfigError


class WithinBudgetTest(unittest.TestCase):

    def test_the_most_frequent_interval_whose_saves_cost_at_most_the_budget(self):
        # ResNet-18 on 2 devices (Zen 4): a 1.95 s step, a 0.147 s save; 2% allows one in 4.
        self.assertEqual(save_interval.within_budget(1.95, 0.147, 0.02), 4)
        self.assertLessEqual(0.147 / (4 * 1.95), 0.02)
        self.assertGreater(0.147 / (3 * 1.95), 0.02)
        self.assertEqual(save_interval.within_budget(1.0, 0.06, 0.02), 3)  # Exactly 2% at 3.
        self.assertEqual(save_interval.within_budget(0.01, 0.147, 0.02), 735)
        self.assertEqual(save_interval.within_budget(10.0, 0.1, 0.02), 1)  # Every step.
        self.assertEqual(save_interval.within_budget(1.0, 0.0, 0.02), 1)

    def test_its_line_says_the_interval_the_times_and_the_cost(self):
        self.assertEqual(save_interval.describe(4, 1.95, 0.147, 0.02, epoch_steps=12),
                         "Saving every 4 step(s) inside an epoch: a save took 0.147 s and a "
                         "step 1.95 s, so these saves cost 1.88% of the training time (budget "
                         "2%).")
        # Where the data does not say how long an epoch is, the line says what that means.
        self.assertEqual(save_interval.describe(4, 1.95, 0.147, 0.02),
                         "Saving every 4 step(s) inside an epoch: a save took 0.147 s and a "
                         "step 1.95 s, so these saves cost 1.88% of the training time (budget "
                         "2%). The data does not say how many steps an epoch has: an epoch of "
                         "fewer is saved at its end only.")
        self.assertEqual(save_interval.describe(40, 0.02, 0.016, 0.0001, epoch_steps=30),
                         "Saving at epochs' ends only: a save took 0.016 s and a step 0.02 s, "
                         "so the most frequent saves within the budget of 0.01% of the "
                         "training time come every 40 steps, and an epoch has 30.")

    def test_a_line_whose_interval_is_not_what_its_times_give_says_why(self):
        # Rounded up to whole calls of several steps, or a job's longest (another worker's):
        # the line's own arithmetic must still hold (0.03 / (0.5 * 0.01) is every 6).
        self.assertEqual(
            save_interval.describe(8, 0.01, 0.03, 0.5, 23, here=8, chosen=6),
            "Saving every 8 step(s) inside an epoch (rounded up from 6 to whole calls of the "
            "step): a save took 0.03 s and a step 0.01 s, so these saves cost 37.5% of the "
            "training time (budget 50%).")
        self.assertEqual(
            save_interval.describe(30, 0.01, 0.03, 0.5, 23, here=6, chosen=6),
            "Saving at epochs' ends only: a save took 0.03 s and a step 0.01 s, so the most "
            "frequent saves within the budget of 50% of the training time come every 30 steps "
            "(the longest of the job's workers' intervals; 6 here), and an epoch has 23.")

    def test_an_interval_and_a_budget_are_checked_in_one_line(self):
        self.assertEqual(save_interval.checked_interval("12"), 12)
        self.assertEqual(save_interval.checked_interval(np.int64(3)), 3)
        self.assertEqual(save_interval.checked_interval("auto"), "auto")
        for bad in (-1, 2.5, True, "often", "\u00b2", "\u0663", " auto", np.array([1, 2])):
            with self.assertRaisesRegex(ConfigError, r"^save_every_steps must be an integer "
                                                     r">= 0 \(0: at epochs' ends only\) or "
                                                     r"'auto'\. Received: save_every_steps="):
                save_interval.checked_interval(bad)
        self.assertEqual(save_interval.checked_budget(np.float32(0.5)), 0.5)
        for bad in (0, 1, 1e-320, 5e-324, -0.5, float("nan"), float("inf"), True, "2%"):
            with self.assertRaisesRegex(ConfigError, r"^save_budget must be a fraction of the "
                                                     r"training time from 0\.0001 to below 1 "):
                save_interval.checked_budget(bad)


class IntervalChooserTest(unittest.TestCase):

    def test_times_steps_but_an_epochs_first_and_every_save_then_takes_the_medians(self):
        now = itertools.count(0.0, 0.5)  # Every reading of the clock is 0.5 s later.
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: next(now))
        for steps in range(1, save_interval.CALLS_TIMED + 1):  # The first is not timed.
            self.assertFalse(chooser.ready)
            chooser.step_ended(steps)
        steps = save_interval.CALLS_TIMED + 1
        chooser.step_ended(steps)
        # The saves before the interval is chosen come CALLS_TIMED calls apart: the first
        # builds what later saves reuse, so a choice from it alone would save too seldom.
        for _ in range(save_interval.SAVES_TIMED):
            self.assertTrue(chooser.ready)
            self.assertFalse(chooser.timed)
            chooser.timed_save(lambda: None)  # 0.5 s.
            for _ in range(save_interval.CALLS_TIMED):
                self.assertFalse(chooser.ready)
                steps += 1
                chooser.step_ended(steps)
        self.assertTrue(chooser.timed)  # Counted: every worker of a job at the same save.
        self.assertEqual(chooser.choose(), 50)  # 0.5 / (0.02 * 0.5).
        self.assertEqual((chooser.step_seconds, chooser.save_seconds), (0.5, 0.5))

    def test_several_steps_per_call_a_new_epoch_and_a_slow_first_save(self):
        times = iter([0.0, 4.0, 13.0, 17.0, 17.0, 19.0, 20.0, 30.0, 30.0, 31.0, 32.0])
        chooser = save_interval.IntervalChooser(0.1, clock=lambda: next(times))
        chooser.step_ended(2)
        chooser.step_ended(6)  # 4 steps in 4 s: 1 s each.
        chooser.epoch_ended()
        chooser.step_ended(1)  # A new epoch's first call (after evaluation, a save): not timed.
        chooser.step_ended(3)  # 2 steps in 4 s.
        chooser.timed_save(lambda: False)  # 2 s: the first save, the slowest.
        self.assertEqual(chooser.save_seconds, 2.0)  # The only one.
        chooser.step_ended(5)  # 2 steps in 1 s, after the save.
        chooser.timed_save(lambda: False)  # 0 s.
        chooser.timed_save(lambda: False)  # 1 s.
        self.assertEqual(chooser.step_seconds, 1.0)  # Of 1, 2 and 0.5.
        self.assertEqual(chooser.save_seconds, 0.5)  # Of 0 and 1: the first is left out.
        self.assertEqual(chooser.choose(), 5)  # 0.5 / (0.1 * 1).


class WriteModeTest(unittest.TestCase):
    """How a save is written, chosen from the costs timed: a fake clock moved by the steps and
    saves as a run's would be."""

    def run_saves(self, slowed_step: float, writes_share_cores: bool = True,
                  in_background: bool | None = None) -> save_interval.IntervalChooser:
        """1 s steps; a first save of 3 s within the step, then saves of 0.1 s in the
        background (the two calls after each take ``slowed_step``) or 0.5 s within."""
        now = [0.0]
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: now[0],
                                                writes_share_cores=writes_share_cores,
                                                in_background=in_background)
        self.ways = []
        steps = 0

        def call(seconds: float, writing: bool) -> None:
            nonlocal steps
            now[0] += seconds
            steps += 1
            chooser.step_ended(steps, writing=writing)

        for _ in range(4):
            call(1.0, False)
        for first in (True, False, False, False):
            background = chooser.next_in_background()
            self.ways.append(background)

            def save(background=background, first=first) -> bool:
                now[0] += 0.1 if background else 3.0 if first else 0.5
                return background

            chooser.timed_save(save)
            call(slowed_step if background else 1.0, background)
            call(slowed_step if background else 1.0, False)
            call(1.0, False)
        return chooser

    def test_the_cheaper_way_measured_with_the_steps_a_write_slows(self):
        # A write that slows the two steps beside it by 0.5 s each costs 1.1 s a save: more
        # than 0.5 s within the step (one device taking both cores).
        chooser = self.run_saves(slowed_step=1.5)
        self.assertEqual(self.ways, [False, True, False, False])
        self.assertAlmostEqual(chooser.background_seconds, 1.1)
        self.assertEqual(chooser.within_seconds, 0.5)
        self.assertEqual(chooser.save_seconds, 0.5)
        self.assertEqual(chooser.choose(), 25)  # 0.5 / (0.02 * 1).
        self.assertEqual(chooser.how, "a save written within the step took 0.5 s (in the "
                                      "background it cost 1.1 s)")
        # Slowed by 0.05 s each: 0.2 s a save, less than 0.5.
        chooser = self.run_saves(slowed_step=1.05)
        self.assertEqual(self.ways, [False, True, False, True])
        self.assertAlmostEqual(chooser.background_seconds, 0.2)
        self.assertAlmostEqual(chooser.save_seconds, 0.2)  # No write timed: the slowed steps.
        # The budget counts the write's whole time where it is longer than the slowing.
        chooser.timed_write(0.3)
        self.assertTrue(chooser.next_in_background())  # The way is chosen by the slowing.
        self.assertAlmostEqual(chooser.save_seconds, 0.4)
        self.assertEqual(chooser.choose(), 20)  # 0.4 / (0.02 * 1).
        self.assertEqual(chooser.how, "a save written in the background held the step 0.1 s "
                                      "and its write took 0.3 s on the cores the step runs on "
                                      "(the steps beside it slowed by 0.1 s; within the step a "
                                      "save took 0.5 s)")

    def test_a_write_at_an_epochs_end_no_step_was_timed_beside_costs_its_whole_time(self):
        # Saves at epochs' ends only: a write runs beside the evaluation and the next epoch's
        # first call, never timed; its cost is not the copy's alone.
        now = [0.0]
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: now[0],
                                                writes_share_cores=True, in_background=None)
        ways = []
        for _ in range(5):  # Epochs of 4 steps of 0.1 s.
            for steps in range(1, 5):
                now[0] += 0.1
                chooser.step_ended(steps, writing=False)
            background = chooser.next_in_background()
            ways.append(background)

            def save(background=background) -> bool:
                now[0] += 0.01 if background else 0.3
                return background

            chooser.timed_save(save)
            if background:
                chooser.timed_write(0.5)
            chooser.epoch_ended()
        self.assertIsNone(chooser.slowed_seconds)
        self.assertAlmostEqual(chooser.background_seconds, 0.51)
        self.assertEqual(ways, [False, True, False, False, False])
        self.assertEqual(chooser.how, "a save written within the step took 0.3 s (in the "
                                      "background it cost 0.51 s)")
        chooser = save_interval.IntervalChooser(0.02, writes_share_cores=True,
                                                in_background=True)
        chooser.timed_save(lambda: False)
        chooser.timed_save(lambda: True)
        chooser.timed_write(0.5)
        self.assertRegex(chooser.how, r"its write took 0\.5 s on the cores the step runs on "
                                      r"\(no step was timed beside it; within the step a save "
                                      r"took [0-9.e-]+ s\)$")

    def test_beside_an_accelerator_or_when_told_the_way_is_not_chosen(self):
        chooser = self.run_saves(slowed_step=1.5, writes_share_cores=False)
        self.assertEqual(chooser.slowed_seconds, 0.0)  # The steps are not the write's.
        self.assertEqual(chooser.how, "a save written in the background held the step 0.1 s, "
                                      "its write running beside the step (within the step: "
                                      "0.5 s)")
        self.run_saves(slowed_step=1.05, in_background=False)
        self.assertEqual(self.ways, [False] * 4)
        self.run_saves(slowed_step=1.5, in_background=True)
        self.assertEqual(self.ways, [False, True, True, True])  # The first is timed whole.

    @staticmethod
    def save_after_a_write_in_flight(writes_share_cores: bool) -> save_interval.IntervalChooser:
        """1 s steps; a first save of 3 s within the step, then one in the background holding
        the step 0.1 s, beside whose write a step takes 1.5 s; the next save waits 0.4 s for
        the write to end, then takes 0.5 s within the step."""
        now, steps = [0.0], 0
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: now[0],
                                                writes_share_cores=writes_share_cores,
                                                in_background=None)

        def call(seconds: float, writing: bool = False) -> None:
            nonlocal steps
            now[0] += seconds
            steps += 1
            chooser.step_ended(steps, writing=writing)

        def taking(seconds: float, background: bool = False) -> Callable[[], bool]:
            def run() -> bool:
                now[0] += seconds
                return background
            return run

        call(1.0)
        call(1.0)
        chooser.timed_save(taking(3.0), wait=lambda: None)
        call(1.0)
        chooser.timed_save(taking(0.1, background=True), wait=lambda: None)
        call(1.5, writing=True)
        chooser.timed_save(taking(0.5), wait=taking(0.4))
        return chooser

    def test_a_save_waiting_for_the_write_before_counts_the_wait_to_that_write(self):
        for writes_share_cores, slowed in ((True, 0.9), (False, 0.4)):
            chooser = self.save_after_a_write_in_flight(writes_share_cores)
            self.assertTrue(chooser.timed)
            self.assertEqual(chooser.within_seconds, 0.5)  # Not 0.9: the wait is the write's.
            self.assertAlmostEqual(chooser.slowed_seconds, slowed)
            self.assertAlmostEqual(chooser.background_seconds, 0.1 + slowed)

    def test_a_wait_for_an_epochs_end_write_beside_no_timed_step_counts_too(self):
        # An epoch's end save written in the background (0.1 s held); the next epoch's first
        # call (not timed) runs beside its write, and the save after it waits 5 s for it.
        now, steps = [0.0], 0
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: now[0],
                                                writes_share_cores=True, in_background=None)

        def taking(seconds: float, background: bool = False) -> Callable[[], bool]:
            def run() -> bool:
                now[0] += seconds
                return background
            return run

        for steps in (1, 2, 3):
            now[0] += 1.0
            chooser.step_ended(steps)
        chooser.timed_save(taking(0.3), wait=lambda: None)  # The first, within the step.
        chooser.timed_save(taking(0.1, background=True), wait=lambda: None)  # The epoch's end.
        chooser.epoch_ended()
        now[0] += 1.0
        chooser.step_ended(1, writing=True)  # The next epoch's first call: not timed.
        chooser.timed_save(taking(0.2), wait=taking(5.0))
        self.assertAlmostEqual(chooser.slowed_seconds, 5.0)
        self.assertAlmostEqual(chooser.background_seconds, 5.1)
        self.assertFalse(chooser.next_in_background())  # 0.2 s within the step is cheaper.

    def test_the_way_is_checked_in_one_line(self):
        self.assertIsNone(save_interval.checked_write_mode("auto"))
        self.assertIs(save_interval.checked_write_mode(False), False)
        for bad in (1, "yes", None, "AUTO"):
            with self.assertRaisesRegex(ConfigError, r"^write_in_background must be True \(in "
                                                     r"the background\), False \(within the "
                                                     r"step\) or 'auto' "):
                save_interval.checked_write_mode(bad)
