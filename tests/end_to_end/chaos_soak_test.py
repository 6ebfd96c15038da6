"""The chaos soak (``chaos_soak.py``): faults of every kind, seeded, and the job still ends
with the uninterrupted run's weights, loadable checkpoints and each epoch once in its output.

The short soak (one fault of each kind, about 4 minutes on 2 cores) has the ``cluster`` marker:
``.ci/run`` runs it with ``pytest -m cluster``. The long one (24 faults) is ``slow``.
"""

import os

import chaos_soak
import pytest
import tensorflow as tf


class ChaosSoakTest(tf.test.TestCase):

    def soak(self, seed, faults, epochs):
        work = self.get_temp_dir()
        reference = chaos_soak.uninterrupted(os.path.join(work, "uninterrupted"), epochs)
        self.assertNotEmpty(reference[0])
        log_path = os.path.join(work, "soak.log")
        with open(log_path, "w", encoding="utf-8") as log:
            report = chaos_soak.soak(seed, faults, epochs, os.path.join(work, "soak"),
                                     reference, log)
        with open(log_path, encoding="utf-8") as log:
            context = f"seed {seed}: {report}\n" + log.read()[-4000:]
        self.assertEqual(report.mismatched, [], context)
        self.assertEqual(report.unloadable, [], context)
        self.assertEqual(report.epochs_in_output, epochs, context)
        return report, context

    @pytest.mark.cluster
    def test_one_fault_of_each_kind(self):
        report, context = self.soak(seed=1, faults=len(chaos_soak.KINDS), epochs=18)
        self.assertEqual(report.faults, dict.fromkeys(chaos_soak.KINDS, 1), context)
        self.assertEqual(report.launches, 2, context)  # The launcher killed once, run again.

    @pytest.mark.slow
    def test_the_long_soak(self):
        report, context = self.soak(seed=1, faults=24, epochs=56)
        self.assertEqual(sum(report.faults.values()), 24, context)
        self.assertLen(report.faults, len(chaos_soak.KINDS))


if __name__ == "__main__":
    tf.test.main()
