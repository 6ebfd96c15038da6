"""Preemption notices in one process: training stops at a step boundary, saves there, and a rerun
resumes at the next step with the weights, metrics and history of an uninterrupted run."""

import contextlib
import dataclasses
import os
import re
import signal
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from conftest import checkpoint_values

import tfpar
from tfpar import data
from tfpar import strategies
from tfpar import testing
from tfpar import training
from tfpar.callbacks import EpochCheckpoint
from tfpar.callbacks import SaveOnPreemption
from tfpar.cluster import preemption
from tfpar.compat import keras_fixes
from tfpar.training import evaluation
from tfpar.training import run as training_run

# 100 examples at a global batch of 8: 13 steps an epoch, the last one of 4 examples.
STEPS_PER_EPOCH = 13


def small_splits():
    return data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(100, 20))


class SignalAt(keras.callbacks.Callback):
    """Sends this process ``signum`` after step ``step`` (1-based) of epoch ``epoch`` (1-based),
    ``times`` times on consecutive steps (step 0: as the epoch begins, before its first step);
    or, with ``in_test``, while the epoch's test accuracy is evaluated."""

    def __init__(self, epoch, step=0, signum=signal.SIGUSR1, times=1, in_test=False):
        super().__init__()
        self.epoch, self.step, self.signum, self.times = epoch, step, signum, times
        self.in_test, self._epoch, self.sent = in_test, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        if not self.in_test and self._epoch == self.epoch and self.step == 0:
            self.sent += 1
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, batch, logs=None):
        if (not self.in_test and self._epoch == self.epoch
                and self.step <= batch + 1 < self.step + self.times):
            self.sent += 1
            os.kill(os.getpid(), self.signum)

    def on_test_batch_end(self, batch, logs=None):
        if self.in_test and self._epoch == self.epoch and not self.sent:
            self.sent += 1
            os.kill(os.getpid(), self.signum)




class PreemptedRunTest(testing.StrategyTestCase):

    def setUp(self):
        super().setUp()
        self.addCleanup(preemption.NOTICE.reset)  # No grace budget outlives a test.

    def preempt_and_resume(self, config, signal_at, devices=2, during=contextlib.nullcontext):
        """Trains ``config`` without and with a notice (``signal_at``, or ``during()`` around
        the preempted run), then a rerun; returns the stop's message and the two results."""
        base, splits = self.get_temp_dir(), small_splits()
        whole = training.train_on_devices(
            dataclasses.replace(config, model_dir=os.path.join(base, "whole")), devices, splits)
        parts = dataclasses.replace(config, model_dir=os.path.join(base, "parts"))
        with self.assertRaises(preemption.Preempted) as stopped, during():
            training.train_on_devices(parts, devices, splits, callbacks=[signal_at])
        self.assertEqual(stopped.exception.code, preemption.PREEMPTED_EXIT_STATUS)
        preemption.NOTICE.reset()
        resumed = training.train_on_devices(parts, devices, splits)
        run = training_run.run_folder("", config.strategy.name, devices)
        expected = checkpoint_values(os.path.join(base, "whole", run))
        actual = checkpoint_values(os.path.join(base, "parts", run))
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertAllClose(expected[name], actual[name], rtol=1e-6, atol=1e-7, msg=name)
        for name, values in whole.history.items():
            if name not in ("epoch_seconds", "images_per_second"):  # Timings differ.
                self.assertAllClose(values, resumed.history[name], rtol=1e-5, msg=name)
        return stopped.exception.message, whole, resumed

    @parameterized.named_parameters(
        ("mirrored", "mirrored", {}, 1),
        # 13 steps an epoch do not divide by 2: each epoch's data ends with it.
        ("allreduce_two_steps_per_call", "allreduce", {}, 2),
        ("allreduce_accumulating", "allreduce", {"accumulation_steps": 2}, 1))
    def test_a_notice_mid_epoch_stops_after_the_step_and_resumes_at_the_next(
            self, strategy, options, steps_per_execution):
        config = training.TrainConfig(strategy=strategies.choose(strategy, **options),
                                      dataset="synthetic", epochs=3, batch_size=8, verbose=0,
                                      steps_per_execution=steps_per_execution)
        stop_at = mock.Mock(wraps=preemption.NOTICE.stop_at)
        message, _, resumed = self.preempt_and_resume(
            config, SignalAt(2, 2 * steps_per_execution),
            during=lambda: mock.patch.object(preemption.NOTICE, "stop_at", stop_at))
        # One process stops at the first step boundary after the notice: the next call's end.
        stop = 3 * steps_per_execution
        # The notice knew the state it waited for (to tell a save cut short from one done).
        self.assertEqual(stop_at.call_args_list, [mock.call((1, stop))])
        self.assertRegex(message, rf"^Preempted \(SIGUSR1\): state saved at epoch 2 step {stop} in"
                                  rf" .*_2_devices, [\d.]+ s after the notice; run the same "
                                  r"command to resume\.$")
        self.assertLen(resumed.epoch_seconds, 2)  # The rest of epoch 2, and epoch 3.

    def test_a_notice_at_an_epochs_first_step(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0)
        message, _, _ = self.preempt_and_resume(config, SignalAt(2, 0, signal.SIGTERM), 1)
        self.assertRegex(message, r"^Preempted \(SIGTERM\): state saved at epoch 2 step 1 in ")

    def test_a_notice_at_an_epochs_last_step_stops_once_the_epoch_ended(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=3,
                                      batch_size=8, verbose=0)
        stop_at = mock.Mock(wraps=preemption.NOTICE.stop_at)
        message, _, resumed = self.preempt_and_resume(
            config, SignalAt(1, STEPS_PER_EPOCH - 1), 1,
            during=lambda: mock.patch.object(preemption.NOTICE, "stop_at", stop_at))
        self.assertRegex(message, r"^Preempted \(SIGUSR1\): state saved at the end of epoch 1 ")
        self.assertEqual(stop_at.call_args_list, [mock.call((1, 0))])
        self.assertLen(resumed.epoch_seconds, 2)

    def test_two_notices_stop_once(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0)
        message, _, _ = self.preempt_and_resume(config, SignalAt(1, 4, times=2), 2)
        self.assertRegex(message, r"state saved at epoch 1 step 5 in ")

    def test_a_notice_during_the_test_evaluation_stops_after_the_next_step(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0)
        evaluate = evaluation.TestAccuracy.on_epoch_end

        def signalled_evaluation(callback, epoch, logs=None):
            if epoch == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            return evaluate(callback, epoch, logs)

        message, _, _ = self.preempt_and_resume(
            config, keras.callbacks.Callback(), 2,
            lambda: mock.patch.object(evaluation.TestAccuracy, "on_epoch_end",
                                      signalled_evaluation))
        self.assertRegex(message, r"state saved at epoch 2 step 1 in ")

    def test_a_notice_during_a_save_stops_after_the_next_step(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0)
        save = EpochCheckpoint._snapshot

        def signalled_save(checkpoint, epochs, steps, saving):
            if epochs == 1 and not steps:
                os.kill(os.getpid(), signal.SIGUSR1)
            return save(checkpoint, epochs, steps, saving)

        message, _, _ = self.preempt_and_resume(
            config, keras.callbacks.Callback(), 1,
            lambda: mock.patch.object(EpochCheckpoint, "_snapshot", signalled_save))
        self.assertRegex(message, r"state saved at epoch 2 step 1 in ")

    def test_without_a_checkpoint_training_stops_and_says_nothing_was_saved(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0)
        with self.assertRaises(preemption.Preempted) as stopped:
            training.train_on_devices(config, 1, small_splits(), callbacks=[SignalAt(1, 3)])
        self.assertEqual(stopped.exception.message,
                         "Preempted (SIGUSR1): stopped at epoch 1 step 4; nothing was saved (no "
                         "checkpoint), " + stopped.exception.message.split(", ")[-1])

    def test_a_state_saved_inside_an_epoch_needs_the_fit_fix(self):
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=8, verbose=0, model_dir=self.get_temp_dir())
        with self.assertRaises(preemption.Preempted):
            training.train_on_devices(config, 1, small_splits(), callbacks=[SignalAt(1, 3)])
        preemption.NOTICE.reset()
        with mock.patch.object(keras_fixes, "skip_reason", lambda: "TFPAR_KERAS_FIXES=off"), \
                self.assertRaisesRegex(Exception, r"was saved at step 4 of epoch 1; resuming "
                                                  r"inside an epoch needs tfpar's fix of Keras's "
                                                  r"fit, which is not applied \(TFPAR_KERAS_FIX"):
            training.train_on_devices(config, 1, small_splits())


def users_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(16, "relu")(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def users_data():
    rng = np.random.default_rng(0)
    return rng.random((80, 8), dtype=np.float32), rng.integers(0, 3, 80)


class UsersFitTest(testing.StrategyTestCase):
    """A user's own ``model.fit`` with validation, under plain Keras callbacks and tfpar's."""

    def setUp(self):
        super().setUp()
        self.addCleanup(preemption.NOTICE.reset)

    @parameterized.parameters("mirrored", "allreduce")
    def test_save_on_preemption_under_plain_fit(self, entry):
        x, y = users_data()

        def fit(state, notice=None):
            strategy = tfpar.strategies.get(entry, devices=2)
            with strategy.scope():
                model = users_model()
            checkpoint = EpochCheckpoint(state, model, strategy)
            history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                                validation_data=(x[:16], y[:16]),
                                initial_epoch=checkpoint.restore(),
                                callbacks=[checkpoint,
                                           SaveOnPreemption(checkpoint, exit_process=False),
                                           *([notice] if notice else [])])
            return model, history

        base = self.get_temp_dir()
        whole, _ = fit(os.path.join(base, "whole"))
        with self.assertRaises(preemption.Preempted) as stopped:  # During validation.
            fit(os.path.join(base, "parts"), SignalAt(1, in_test=True, signum=signal.SIGTERM))
        self.assertIn("state saved at epoch 2 step 1 in ", stopped.exception.message)
        preemption.NOTICE.reset()
        resumed, history = fit(os.path.join(base, "parts"))
        for expected, actual in zip(whole.get_weights(), resumed.get_weights()):
            self.assertAllClose(expected, actual, rtol=1e-6, atol=1e-7)
        self.assertLen(history.history["loss"], 2)  # Epochs 2 (from step 1) and 3.

    def test_backup_and_restore_resumes_at_the_step_it_saved(self):
        x, y = users_data()

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if self.model.optimizer.iterations.numpy() == 8:  # Epoch 2, step 3.
                    raise RuntimeError("killed")

        def fit(backup, *extra):
            strategy = tfpar.strategies.get("mirrored", devices=2)
            with strategy.scope():
                model = users_model()
            history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3),
                                           *extra])
            return model, history

        base = self.get_temp_dir()
        whole, whole_history = fit(os.path.join(base, "whole"))
        with self.assertRaisesRegex(RuntimeError, "killed"):
            fit(os.path.join(base, "parts"), Crash())  # Saved after step 6: epoch 2, step 1.
        resumed, history = fit(os.path.join(base, "parts"))
        for expected, actual in zip(whole.get_weights(), resumed.get_weights()):
            self.assertAllClose(expected, actual, rtol=1e-6, atol=1e-7)
        # Epochs 2 and 3, the second's loss over all its steps (the first from the backup).
        self.assertAllClose(whole_history.history["loss"][1:], history.history["loss"],
                            rtol=1e-5)


class GraceBudgetTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(float("inf"), float("nan"), 1e10, 86400.5, 0, -1)
    def test_a_budget_the_waits_cannot_hold_is_refused_up_front(self, seconds):
        # inf and 1e10 passed the check, then overflowed the first wait on the budget.
        with self.assertRaisesRegex(tfpar.errors.ConfigError,
                                    r"^preemption_grace_seconds must be a finite number of "
                                    r"seconds > 0 and at most 86400 \(a day\)\. Received: "
                                    f"{re.escape(repr(seconds))}\\.$"):
            SaveOnPreemption(grace_seconds=seconds)

    def test_a_day_is_accepted(self):
        self.assertEqual(SaveOnPreemption(grace_seconds=86400).grace_seconds, 86400)


if __name__ == "__main__":
    tf.test.main()
