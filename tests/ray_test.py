"""Tests of tfpar under Ray Train: a real local Ray runtime, kept on a private loopback.

One Ray job (``ray_job.py``, about 4 minutes on 2 cores) runs a user's train loop under
``TensorflowTrainer`` with 2 workers eight times: ``multi_worker``, ``multi_worker_allreduce``,
``multi_worker`` with a worker killed (SIGKILL, restarted by Ray) or sent SIGTERM, a BatchNorm
model reported every step (and killed inside an epoch), and ``keras.distribution`` through tfpar
(and killed); its
first worker also records what ``tf.keras`` is there and in the processes it starts. Another
(``ray_elastic_job.py``, about a minute) shrinks an elastic job when a node of a local
3-node Ray cluster leaves.
Run with ``pytest -m ray`` after ``pip install -e ".[ray]"``; ``.ci/run`` does both and sets
``TFPAR_REQUIRE_RAY=1``, so there a missing Ray fails rather than skips.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import private_network

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "ray", "train.py")

pytestmark = pytest.mark.ray

try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("TFPAR_REQUIRE_RAY"):
        raise
    pytest.skip('Ray is not installed: pip install -e ".[ray]"', allow_module_level=True)

import ray_job  # noqa: E402  (after the skip: it imports Ray)


class RayTrainTest(tf.test.TestCase, parameterized.TestCase):
    out = ""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.out = os.path.join(tf.compat.v1.test.get_temp_dir(), "ray_job")
        os.makedirs(cls.out, exist_ok=True)
        initial = os.path.join(cls.out, "initial.npz")
        np.savez(initial, *ray_job.user_model().get_weights())
        # Outside a namespace Ray would put this machine's address into TF_CONFIG.
        with private_network.Namespace() as network:
            job = subprocess.Popen([sys.executable, os.path.join(HERE, "ray_job.py"), initial,
                                    cls.out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, preexec_fn=network.enter,
                                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                        "RAY_DISABLE_USAGE_STATS": "1"})
        try:
            cls.output = job.communicate(timeout=600)[0]
        finally:
            job.kill()
        cls.status = job.returncode

    def result(self, name):
        self.assertEqual(self.status, 0, self.output[-5000:])
        with open(os.path.join(self.out, f"{name}.json")) as f:
            return json.load(f)

    def reference(self):
        """The same model and global batch trained in one process."""
        model = ray_job.user_model()
        model.set_weights(list(np.load(os.path.join(self.out, "initial.npz")).values()))
        x, y = ray_job.data()
        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
                            epochs=ray_job.EPOCHS, verbose=0)
        return model.get_weights(), history.history["loss"][-1]

    def assert_weights(self, name, expected):
        actual = list(np.load(os.path.join(self.out, f"{name}.npz")).values())
        for want, got in zip(expected, actual):
            self.assertAllClose(want, got, rtol=1e-5, atol=1e-6)

    def test_tf_keras_is_keras_3_in_the_worker_and_in_tfpars_workers_it_starts(self):
        # Ray's TensorflowTrainer sets TF_USE_LEGACY_KERAS=1 in its workers: with tf_keras
        # installed, a process a Ray worker starts gets Keras 2 for tf.keras; the workers of
        # tfpar's launcher get Keras 3, as tfpar's strategies need.
        self.assertEqual(self.status, 0, self.output[-5000:])
        with open(os.path.join(self.out, "keras_versions.json")) as f:
            versions = json.load(f)
        self.assertEqual(versions["switch"], "1")
        self.assertEqual(versions["worker"], "keras")
        self.assertEqual(versions["launcher_worker"], "keras")
        self.assertIn("is not passed to the workers", versions["launcher_said"])
        try:
            import tf_keras  # noqa: F401
        except ImportError:
            self.assertEqual(versions["started_process"], "")  # TensorFlow cannot import it.
        else:
            self.assertEqual(versions["started_process"], "tf_keras")

    @parameterized.parameters("multi_worker", "multi_worker_allreduce")
    def test_two_ray_workers_train_as_one_process_and_report_to_ray(self, name):
        result = self.result(name)
        weights, loss = self.reference()
        self.assert_weights(name, weights)
        self.assertEqual(result["metrics"]["epoch"], ray_job.EPOCHS)
        self.assertAllClose(result["metrics"]["loss"], loss, rtol=1e-5)
        # One checkpoint per epoch, the chief's, holding tfpar's state after the last epoch.
        self.assertEqual(os.path.basename(result["checkpoint"]), "epoch_000003")
        state = tf.train.load_checkpoint(result["checkpoint"])
        self.assertEqual(state.get_tensor("epochs_done/.ATTRIBUTES/VARIABLE_VALUE"), 3)
        self.assertEqual(sorted(n for n in os.listdir(os.path.dirname(result["checkpoint"]))
                                if n.startswith("epoch_")),
                         ["epoch_000001", "epoch_000002", "epoch_000003"])

    def test_a_killed_worker_is_restarted_by_ray_and_resumes_exactly(self):
        result = self.result("killed")
        # Both workers started at epoch 0, and again at epoch 1 from Ray's checkpoint.
        self.assertEqual(result["starts"], ["0 0", "0 1", "1 0", "1 1"], self.output[-3000:])
        self.assertIsNone(result["error"])
        uninterrupted = list(np.load(os.path.join(self.out, "multi_worker.npz")).values())
        resumed = list(np.load(os.path.join(self.out, "killed.npz")).values())
        for want, got in zip(uninterrupted, resumed):
            self.assertAllEqual(want, got)

    def test_keras_distribution_trains_as_its_entry_and_resumes_exactly_after_a_kill(self):
        # keras.distribution.DataParallel() set in each Ray worker trains through
        # multi_worker_allreduce and ends where that entry ends, bit for bit; killed as
        # `killed` is, Ray restarts it from the epoch-1 checkpoint, and it ends the same.
        result = self.result("keras_distribution")
        self.assertIsNone(result["error"])
        entry = list(np.load(os.path.join(self.out, "multi_worker_allreduce.npz")).values())
        mine = list(np.load(os.path.join(self.out, "keras_distribution.npz")).values())
        self.assertLen(mine, 4)
        for want, got in zip(entry, mine):
            self.assertAllEqual(want, got)
        killed = self.result("keras_distribution_killed")
        self.assertEqual(killed["starts"], ["0 0", "0 1", "1 0", "1 1"], self.output[-3000:])
        self.assertIsNone(killed["error"])
        resumed = list(np.load(os.path.join(self.out, "keras_distribution_killed.npz")).values())
        for want, got in zip(mine, resumed):
            self.assertAllEqual(want, got)

    def test_a_state_reported_inside_an_epoch_resumes_at_its_step_exactly(self):
        # Reported every step; worker 1 killed after epoch 2's second step: Ray restarts the
        # group from that state, which resumes epoch 2 at its third step with each replica's
        # own BatchNorm statistics, and ends as the uninterrupted job, bit for bit.
        result = self.result("batchnorm_killed_mid_epoch")
        self.assertEqual(result["starts"], ["0 0", "0 1", "1 0", "1 1"], self.output[-3000:])
        self.assertIsNone(result["error"])
        uninterrupted = list(np.load(os.path.join(self.out, "batchnorm.npz")).values())
        resumed = list(np.load(os.path.join(self.out, "batchnorm_killed_mid_epoch.npz")).values())
        self.assertLen(resumed, 8)  # Dense (2), BatchNorm (4), Dense (2).
        for want, got in zip(uninterrupted, resumed):
            self.assertAllEqual(want, got)
        checkpoints = sorted(n for n in os.listdir(os.path.dirname(
            self.result("batchnorm")["checkpoint"])) if n.startswith("epoch_"))
        self.assertIn("epoch_000001_step_000002", checkpoints)

    def test_a_sigterm_to_a_ray_worker_is_swallowed_and_training_goes_on(self):
        # Ray runs the train loop in a thread that is not the process's main thread, so no
        # Python handler can take the signal there; TensorFlow's coordination service, set up
        # with the strategy, catches SIGTERM for its own preemption notifier, and the worker
        # trains on (until a SIGKILL, which the test above shows Ray recovering from).
        result = self.result("terminated")
        self.assertEqual(result["starts"], ["0 0", "1 0"], self.output[-3000:])
        self.assertIsNone(result["error"])
        uninterrupted = list(np.load(os.path.join(self.out, "multi_worker.npz")).values())
        terminated = list(np.load(os.path.join(self.out, "terminated.npz")).values())
        for want, got in zip(uninterrupted, terminated):
            self.assertAllEqual(want, got)


class RayElasticTest(tf.test.TestCase):

    def test_a_node_that_leaves_shrinks_the_job_and_it_ends_as_one_process(self):
        # ScalingConfig(num_workers=(2, 3)) on a 3-node local cluster: 3 workers; the 1-CPU
        # node leaves after epoch 1; Ray first retries at 3 (it still counts the node's CPU),
        # gives up on starting them after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (20 s here,
        # 60 s by default) and starts 2; tfpar's checkpoint of epoch 1 resumes at 2 workers.
        out = os.path.join(self.get_temp_dir(), "ray_elastic")
        os.makedirs(out)
        initial = os.path.join(out, "initial.npz")
        np.savez(initial, *ray_job.user_model().get_weights())
        with private_network.Namespace() as network:
            job = subprocess.Popen([sys.executable, os.path.join(HERE, "ray_elastic_job.py"),
                                    initial, out], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   preexec_fn=network.enter,
                                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                        "RAY_DISABLE_USAGE_STATS": "1",
                                        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"})
        try:
            output = job.communicate(timeout=600)[0]
        finally:
            job.kill()
        self.assertEqual(job.returncode, 0, output[-5000:])
        with open(os.path.join(out, "elastic.json")) as f:
            result = json.load(f)
        self.assertIsNone(result["error"])
        self.assertEqual(result["starts"], ["3 0", "2 1"], output[-3000:])  # (workers, epoch)
        self.assertEqual(result["metrics"]["epoch"], ray_job.EPOCHS)
        model = ray_job.user_model()
        model.set_weights(list(np.load(initial).values()))
        x, y = ray_job.data()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=ray_job.EPOCHS,
                  verbose=0)
        final = list(np.load(os.path.join(out, "elastic.npz")).values())
        for want, got in zip(model.get_weights(), final):
            self.assertAllClose(want, got, rtol=1e-5, atol=1e-6)


class RayExampleTest(tf.test.TestCase):

    def test_the_example_trains_lenet_on_two_ray_workers(self):
        # About 50 s on 2 cores.
        with private_network.Namespace() as network:
            result = subprocess.run(
                [sys.executable, EXAMPLE, "--num_workers=2", "--epochs=1",
                 f"--storage_path={self.get_temp_dir()}"], capture_output=True, text=True,
                timeout=600, preexec_fn=network.enter,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "RAY_DISABLE_USAGE_STATS": "1"})
        self.assertEqual(result.returncode, 0, (result.stdout + result.stderr)[-5000:])
        self.assertRegex(result.stdout, r"test acc: 0\.\d{4} after 1 epochs on 2 Ray workers "
                                        r"\(multi_worker\); checkpoint: .*epoch_000001")
