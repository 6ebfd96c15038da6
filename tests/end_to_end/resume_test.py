"""Tests of kill-and-resume: resumed training ends with the weights of an uninterrupted run."""

import dataclasses
import os
import subprocess
import sys

import conftest
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar import data
from tfpar import testing
from tfpar import training
from tfpar.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def checkpoint_values(directory: str) -> dict[str, np.ndarray]:
    """The model and optimizer tensors, and the epochs, of the latest checkpoint there."""
    return conftest.checkpoint_values(directory, (*conftest.MODEL_AND_OPTIMIZER, "epochs_done/"))


class SameStateTestCase(testing.StrategyTestCase):

    def assertSameState(self, expected_dir, actual_dir):
        expected, actual = checkpoint_values(expected_dir), checkpoint_values(actual_dir)
        self.assertEqual(sorted(expected), sorted(actual))
        self.assertGreater(len(expected), 5)
        for name in expected:
            self.assertAllClose(expected[name], actual[name], rtol=1e-6, atol=1e-7, msg=name)


class ResumeTest(SameStateTestCase):

    @parameterized.parameters("mirrored", "allreduce")
    def test_resumed_training_equals_uninterrupted(self, strategy_name):
        base = self.get_temp_dir()
        config = training.TrainConfig(strategy=strategy_name, dataset="synthetic", epochs=3,
                                      batch_size=48, verbose=0)
        # (The weights show up twice: as model_variables and as the optimizer's.)
        splits = synthetic_splits()
        whole = os.path.join(base, f"{strategy_name}_whole")
        uninterrupted = training.train_on_devices(dataclasses.replace(config, model_dir=whole), 2,
                                                  splits)
        parts = os.path.join(base, f"{strategy_name}_parts")
        partial = dataclasses.replace(config, model_dir=parts, epochs=1)
        training.train_on_devices(partial, 2, splits)  # Stops after epoch 1, as if killed.
        resumed = training.train_on_devices(dataclasses.replace(config, model_dir=parts), 2,
                                            splits)
        self.assertLen(resumed.epoch_seconds, 2)  # Only epochs 2 and 3 ran.
        self.assertEqual(resumed.epochs, 3)
        # Its report holds every epoch once, the first one from the saved history.
        self.assertEqual(sorted(resumed.history), sorted(uninterrupted.history))
        for name, values in uninterrupted.history.items():
            self.assertLen(resumed.history[name], 3, msg=name)
            if name not in ("epoch_seconds", "images_per_second"):  # Timings differ.
                self.assertAllClose(values, resumed.history[name], rtol=1e-5, msg=name)
        sub = f"{strategy_name}_2_devices"
        self.assertSameState(os.path.join(whole, sub), os.path.join(parts, sub))

    def test_state_made_with_something_else_is_refused(self):
        model_dir = self.get_temp_dir()
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=1,
                                      batch_size=48, verbose=0, model_dir=model_dir)
        training.train_on_devices(config, 1, synthetic_splits())
        with self.assertRaisesRegex(ConfigError, r"was made with optimizer='sgd' \(now "
                                                 r"'adam'\)\. Start over \(resume=False\), or "
                                                 r"use another model_dir"):
            training.train_on_devices(dataclasses.replace(config, optimizer="adam", epochs=2),
                                      1, synthetic_splits())
        # Starting over is allowed.
        training.train_on_devices(dataclasses.replace(config, optimizer="adam", resume=False),
                                  1, synthetic_splits())


def synthetic_splits():
    return data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(100, 20))


class KillAndResumeTest(SameStateTestCase):

    def launch(self, model_dir, kill=()):
        # kill=(rank, epoch): that worker is killed right after it saved that epoch.
        train = [os.path.join(ROOT, "scripts", "train.py"), "--strategy=multi_worker",
                 "--dataset=digits", "--epochs=3", "--batch_size=96", "--verbose=0",
                 f"--model_dir={model_dir}"]
        if kill:
            train = [os.path.join(HERE, "train_and_die.py"), *map(str, kill), "--", *train]
        return subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2",
             "--", sys.executable, *train],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_killed_worker_then_restart_resumes_to_the_same_weights(self):
        base = self.get_temp_dir()
        whole, killed = os.path.join(base, "whole"), os.path.join(base, "killed")
        self.assertEqual(self.launch(whole).wait(timeout=300), 0)

        # Worker 1 dies after saving epoch 2 (the chief has saved epoch 1 by then at least).
        job = self.launch(killed, kill=(1, 2))
        state = os.path.join(killed, "multi_worker_1_devices")
        output = job.communicate(timeout=300)[0]
        self.assertNotEqual(job.returncode, 0)
        self.assertIn("launcher: worker 1 was killed by signal 9", output)

        restarted = self.launch(killed)
        output = restarted.communicate(timeout=300)[0]
        self.assertEqual(restarted.returncode, 0, output[-3000:])
        self.assertIn("[worker 0] Resuming from", output)
        self.assertSameState(os.path.join(whole, "multi_worker_1_devices"), state)


if __name__ == "__main__":
    tf.test.main()
