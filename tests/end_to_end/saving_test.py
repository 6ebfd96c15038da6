"""The saving guide's program (docs/guide/saving.md) as a 2-worker job: the model its chief
saved loads and predicts as the model a one-device run of the same program saved."""

import os
import subprocess
import sys

import docs_test
import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = docs_test.ROOT
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


class SavingTest(tf.test.TestCase):

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_a_model_saved_by_a_two_worker_job_predicts_as_one_device(self):
        base = self.get_temp_dir()
        program = os.path.join(base, "save.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(docs_test.block("saving"))
        job = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, program, "multi_worker", os.path.join(base, "job")],
            capture_output=True, text=True, env=ENV, timeout=300)
        self.assertEqual(job.returncode, 0, job.stdout[-3000:])
        one = subprocess.run([sys.executable, program, "default", os.path.join(base, "one")],
                             capture_output=True, text=True, env=ENV, timeout=300)
        self.assertEqual(one.returncode, 0, one.stderr[-3000:])
        self.assertEqual(sorted(os.listdir(os.path.join(base, "job"))),
                         ["model.keras", "serving"])  # The chief's copy only.
        x = np.random.default_rng(1).random((10, 8), dtype=np.float32)
        from_job = keras.saving.load_model(os.path.join(base, "job", "model.keras"))
        from_one = keras.saving.load_model(os.path.join(base, "one", "model.keras"))
        self.assertAllClose(from_job.predict(x, verbose=0), from_one.predict(x, verbose=0),
                            rtol=1e-5, atol=1e-5)
        served = tf.saved_model.load(os.path.join(base, "job", "serving"))
        self.assertAllClose(served.serve(x).numpy(), from_job.predict(x, verbose=0), rtol=1e-5,
                            atol=1e-6)


if __name__ == "__main__":
    tf.test.main()
