"""Tests of multi-worker strategies: threads for collectives, 2, 3 and 4 workers equal one
process (Keras's step and tfpar's, one or several steps per compiled call)."""

import io
import json
import os
import subprocess
import sys

import multi_worker_worker  # The worker program, importable for its model.
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar import testing
from tfpar.cluster import launcher

HERE = os.path.dirname(os.path.abspath(__file__))


class OverlapTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, "threads 1 2"), (1, "threads 1 1"))
    def test_a_worker_with_cores_to_spare_keeps_a_thread_for_its_collectives(
            self, compute_threads, expected):
        # A worker of one CPU device gets 1 inter-op thread from the device split; with it, a
        # profile showed every gradient all-reduce waiting for the end of the backward pass.
        # With one compute thread, the spare thread contended and is not added.
        code = ("from tfpar import devices, strategies\n"
                f"devices.ensure_logical_cpus(1, {compute_threads})\n"
                "import tensorflow as tf\n"
                "before = tf.config.threading.get_inter_op_parallelism_threads()\n"
                "strategies.get('multi_worker', 1)\n"
                "after = tf.config.threading.get_inter_op_parallelism_threads()\n"
                "print('threads', before, after)\n")
        environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        environ.pop("OMP_NUM_THREADS", None)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env=environ)
        self.assertIn(expected, result.stdout, result.stderr[-2000:])

    @parameterized.parameters(("1", "", "threads 1 1"), ("3", "", "threads 3 2"),
                              # The user's own setting (read by TensorFlow itself) wins.
                              ("3", "1", "threads 0 0"))
    def test_a_worker_takes_the_cpus_a_scheduler_gave_it(self, budget, user_intra, expected):
        # Ray sets OMP_NUM_THREADS to a worker's CPUs; TensorFlow itself ignores it.
        code = ("from tfpar import strategies\n"
                "import tensorflow as tf\n"
                "strategies.get('multi_worker', 1)\n"
                "print('threads', tf.config.threading.get_intra_op_parallelism_threads(),\n"
                "      tf.config.threading.get_inter_op_parallelism_threads())\n")
        environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": budget}
        if user_intra:
            environ["TF_NUM_INTRAOP_THREADS"] = user_intra
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env=environ)
        self.assertIn(expected, result.stdout, result.stderr[-2000:])


class WorkersTest(testing.StrategyTestCase, parameterized.TestCase):

    @parameterized.parameters(
        ("multi_worker", 24), ("multi_worker_allreduce", 23),
        # Micro-batches of 2+2 and 2+1 (the last batch) accumulated before one all-reduce.
        ("multi_worker_allreduce", 23, {"accumulation_steps": 2}),
        # Keras's own accumulation: an update every 2 batches, applied by tfpar's step.
        ("multi_worker_allreduce", 23, {"gradient_accumulation_steps": 2}),
        # Keras's loop of 2 steps per compiled call (fit, evaluate), with tfpar's fix for it.
        ("multi_worker", 24, {"steps_per_execution": 2}),
        ("multi_worker_allreduce", 23, {"steps_per_execution": 2}),
        # More workers than cores (one thread each): 4 workers of 2 examples a batch; 3
        # workers of uneven shares (3+3+2, and 3+2+2 in the last batch), exact under tfpar's
        # step (Keras's weighs uneven shards inexactly, so it runs at 4 only).
        ("multi_worker", 24, None, 4), ("multi_worker_allreduce", 23, None, 4),
        ("multi_worker_allreduce", 23, None, 3))
    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_workers_match_single_process_training(self, name, num_examples, options=None,
                                                   num_workers=2):
        reference = multi_worker_worker.model_with_metric(**{
            k: v for k, v in (options or {}).items()
            if k in ("gradient_accumulation_steps", "steps_per_execution")})
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        final = os.path.join(self.get_temp_dir(), "final.npz")
        np.savez(initial, *reference.get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, os.path.join(HERE, "multi_worker_worker.py"),
                                  name, initial, final, json.dumps(options or {})],
                                 num_workers, out=out)
        self.assertEqual(status, 0, out.getvalue()[-3000:])
        expected_logs = multi_worker_worker.StepLogs()
        reference.fit(multi_worker_worker.dataset(num_examples), verbose=0, shuffle=False,
                      callbacks=[expected_logs])
        for expected, actual in zip(reference.get_weights(), np.load(final).values()):
            self.assertAllClose(expected, actual, rtol=1e-5, atol=1e-6)
        # The logged loss and accuracy of every step are the global batch's (averaged across
        # the workers in one collective under Keras's step; global already under tfpar's).
        with open(final + ".logs.json") as f:
            logs = json.load(f)
        self.assertAllClose(expected_logs.steps, logs["steps"], rtol=1e-5, atol=1e-6)
        self.assertAllClose(reference.evaluate(multi_worker_worker.dataset(24), verbose=0,
                                               return_dict=True),
                            logs["evaluate"], rtol=1e-5, atol=1e-6)
        self.assertAllClose(reference.predict(multi_worker_worker.dataset(24), verbose=0),
                            logs["predict"], rtol=1e-5, atol=1e-6)

    @parameterized.parameters(
        # Keras's accumulated update fails inside tf.cond under every mirrored strategy.
        ("multi_worker", {"gradient_accumulation_steps": 2},
         "ConfigError: The optimizer's gradient_accumulation_steps=2 fails under tf.distribute"
         "'s mirrored strategies .* 'multi_worker_allreduce' across workers\\), whose step "
         "applies it exactly"))
    def test_what_keras_cannot_run_across_workers_is_refused_with_the_reason(
            self, name, compile_options, message):
        # A user's compile gets tfpar's one-line reason instead of a failure inside TensorFlow.
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        np.savez(initial, *multi_worker_worker.model_with_metric().get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, os.path.join(HERE, "multi_worker_worker.py"),
                                  name, initial, os.path.join(self.get_temp_dir(), "final.npz"),
                                  json.dumps(compile_options)], 2, out=out)
        self.assertNotEqual(status, 0)
        self.assertRegex(out.getvalue(), message)


if __name__ == "__main__":
    tf.test.main()
