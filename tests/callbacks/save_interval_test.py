"""Tests of the automatic interval of saves inside an epoch: the rule, and its measurement."""

import itertools
import unittest

from tfpar.callbacks import save_interval


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
        self.assertEqual(save_interval.describe(4, 1.95, 0.147, 0.02),
                         "Saving every 4 step(s) inside an epoch: a save took 0.147 s and a "
                         "step 1.95 s, so saving costs 1.9% of the training time (budget "
                         "2.0%).")


class IntervalChooserTest(unittest.TestCase):

    def test_times_steps_but_the_first_and_the_save_then_chooses(self):
        now = itertools.count(0.0, 0.5)  # Every reading of the clock is 0.5 s later.
        chooser = save_interval.IntervalChooser(0.02, clock=lambda: next(now))
        for steps in range(1, save_interval.STEPS_TIMED + 1):  # The first is not timed.
            self.assertFalse(chooser.ready)
            chooser.step_ended(steps)
        chooser.step_ended(save_interval.STEPS_TIMED + 1)
        self.assertTrue(chooser.ready)
        chooser.timed_save(lambda: None)  # 0.5 s.
        self.assertEqual(chooser.choose(), 50)  # 0.5 / (0.02 * 0.5).
        self.assertEqual((chooser.step_seconds, chooser.save_seconds), (0.5, 0.5))

    def test_several_steps_per_call_and_a_new_epoch(self):
        times = iter([0.0, 4.0, 5.0, 9.0, 13.0, 13.0, 14.0])
        chooser = save_interval.IntervalChooser(0.1, clock=lambda: next(times))
        chooser.step_ended(2)
        chooser.step_ended(6)  # 4 steps in 4 s: 1 s each.
        chooser.step_ended(1)  # A new epoch (after its evaluation and save): not timed.
        chooser.step_ended(3)  # 2 steps in 4 s.
        chooser.step_ended(5)  # 2 steps in 4 s.
        self.assertTrue(chooser.ready)
        chooser.timed_save(lambda: None)  # 1 s.
        self.assertEqual(chooser.choose(), 5)  # 1 / (0.1 * the median, 2 s).
        self.assertEqual(chooser.step_seconds, 2.0)
