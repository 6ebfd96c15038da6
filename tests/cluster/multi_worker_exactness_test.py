"""The multi-worker cells of the exactness matrix: a 2-worker job under the launcher, interrupted
(a notice to one worker inside an epoch; one worker killed with ``BackupAndRestore(save_freq=3)``
and the job restarted) and resumed, ends with every variable of every worker's replica equal to
the uninterrupted job's, bit for bit (``tests/end_to_end/exactness_test.py`` has the models and
the one-process cells)."""

import io
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "exactness_worker.py")
PREEMPTED = 85


@pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
class MultiWorkerExactResumeTest(tf.test.TestCase, parameterized.TestCase):

    def job(self, base, entry, model, resume, interrupt, max_restarts=0):
        out = io.StringIO()
        command = [sys.executable, WORKER, entry, model, resume, os.path.join(base, "state"),
                   os.path.join(base, "final"), *(["interrupt"] if interrupt else [])]
        status = launcher.launch(command, 2, out=out, max_restarts=max_restarts,
                                 resumes_itself=True)
        return status, out.getvalue()

    def final(self, base):
        return [dict(np.load(os.path.join(base, f"final.{rank}.npz"))) for rank in (0, 1)]

    @parameterized.named_parameters(
        (f"_{entry}_{model}_{resume}", entry, model, resume)
        for entry in ("multi_worker", "multi_worker_allreduce")
        for model, resume in (("small_resnet", "notice"), ("users_functional", "notice"),
                              ("users_functional", "backup_and_restore_kill")))
    def test_a_resumed_job_ends_where_the_uninterrupted_one_ends(self, entry, model, resume):
        whole, parts = (os.path.join(self.get_temp_dir(), name) for name in ("whole", "parts"))
        status, output = self.job(whole, entry, model, resume, interrupt=False)
        self.assertEqual(status, 0, output[-3000:])
        if resume == "notice":
            status, output = self.job(parts, entry, model, resume, interrupt=True)
            self.assertEqual(status, PREEMPTED, output[-3000:])
            self.assertRegex(output, r"state saved at epoch 2 step [34] ")  # As the workers agree.
            self.assertNotIn("Traceback", output)
            status, output = self.job(parts, entry, model, resume, interrupt=False)
        else:  # (The surviving worker of a user's script is stopped with a traceback.)
            status, output = self.job(parts, entry, model, resume, interrupt=True,
                                      max_restarts=1)
            self.assertIn("launcher: worker 1 was killed by signal 9", output)
        self.assertEqual(status, 0, output[-3000:])
        for expected, actual in zip(self.final(whole), self.final(parts)):
            self.assertEqual(sorted(expected), sorted(actual))
            differ = [name for name in expected if not np.array_equal(expected[name],
                                                                      actual[name])]
            self.assertEqual(differ, [], "variables that differ from the uninterrupted job's")


if __name__ == "__main__":
    tf.test.main()
