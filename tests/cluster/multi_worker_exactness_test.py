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

    def job(self, base, entry, model, resume, interrupt, max_restarts=0, workers=2,
            min_workers=None):
        out = io.StringIO()
        command = [sys.executable, WORKER, entry, model, resume, os.path.join(base, "state"),
                   os.path.join(base, "final"), *(["interrupt"] if interrupt else [])]
        status = launcher.launch(command, workers, out=out, max_restarts=max_restarts,
                                 min_workers=min_workers)
        return status, out.getvalue()

    def final(self, base, ranks=(0, 1)):
        return [dict(np.load(os.path.join(base, f"final.{rank}.npz"))) for rank in ranks]

    def test_an_elastic_job_that_loses_a_worker_of_a_batchnorm_model(self):
        # 3 workers; slot 2 dies for good inside epoch 2; the job goes on with 2 from the
        # state saved after epoch 1, whose replicas' BatchNorm copies (3) come back as their
        # mean on each of the 2. Per-replica BatchNorm normalises each shard by its own
        # statistics, and 2 shards of 8 are not 3 of 5 or 6: a different computation, not
        # rounding (2.2e-2 measured at the end; synchronized BatchNorm does not depend on the
        # shards). The worker's savers record its progress, so the launcher tries slot 2 again
        # once epoch 2 is saved (it no longer fails) and the job grows back to 3. It ends with
        # the same number of steps, close to the 3-worker job.
        whole, parts = (os.path.join(self.get_temp_dir(), name) for name in ("whole", "parts"))
        entry, model = "multi_worker_allreduce", "small_resnet"
        status, output = self.job(whole, entry, model, "elastic", interrupt=False, workers=3)
        self.assertEqual(status, 0, output[-3000:])
        status, output = self.job(parts, entry, model, "elastic", interrupt=True, workers=3,
                                  min_workers=2)
        self.assertEqual(status, 0, output[-3000:])
        self.assertIn("slot 2 is lost (tried again after epoch 2 or at a restart); going on with 2 "
                      "workers of 3",
                      output)
        expected, actual = self.final(whole, (0,))[0], self.final(parts, (0,))[0]
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            if "iteration" in name:  # The same number of steps.
                self.assertEqual(expected[name], actual[name], msg=name)
            else:
                self.assertAllClose(expected[name], actual[name], rtol=0, atol=0.05, msg=name)

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
