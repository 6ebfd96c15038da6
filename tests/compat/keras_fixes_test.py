"""Tests that tfpar's Keras fixes are what make fit survive, and that they know their limits."""

import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import unittest
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfpar import backup_saver
from tfpar import errors
from tfpar import strategies
from tfpar import testing
from tfpar.cluster import launcher
from tfpar.compat import keras_fixes
from tfpar.compat import mid_epoch_resume
from tfpar.compat.keras_fixes import fix
from tfpar.compat.keras_fixes import scalar_logs
from tfpar.errors import DamagedStateError

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster",
                      "multi_worker_worker.py")


def setUpModule():
    # The fixes are installed here without a strategy, which gives BackupAndRestore's its saver.
    keras_fixes.use_backup_saver(backup_saver)


def fit_first_batch_of_five(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((5, 4), np.float32), np.ones((5, 1), np.float32)
    return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(5), verbose=0)


class KerasFixesTest(testing.StrategyTestCase, parameterized.TestCase):

    def tearDown(self):
        keras_fixes.install()  # As a strategy of several replicas leaves them.
        super().tearDown()

    def test_uneven_first_batch_crashes_without_the_fix(self):
        strategy = self.strategy("mirrored", 2)  # Installs the fixes.
        self.assertTrue(keras_fixes.installed())
        keras_fixes.uninstall(("symbolic_build",))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "same size and shape"):
            fit_first_batch_of_five(strategy)

    @parameterized.parameters(True, False)
    def test_a_resumed_epoch_starts_at_its_step_only_with_the_fix(self, fixed):
        strategy = self.strategy("mirrored", 2)  # Installs the fixes.
        if not fixed:
            keras_fixes.uninstall(("mid_epoch_start",))
            self.addCleanup(mid_epoch_resume.start_next_epoch_at, 0)  # Left unread.
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.arange(40, dtype=np.float32).reshape(10, 4)
        seen = []

        class Resume(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                mid_epoch_resume.start_next_epoch_at(3)

            def on_train_batch_begin(self, batch, logs=None):
                seen.append(batch)

        model.fit(x, x[:, :1], batch_size=2, shuffle=False, verbose=0, callbacks=[Resume()])
        # Without the fix, Keras trains the epoch's first 3 steps again.
        self.assertEqual(seen, [3, 4] if fixed else [0, 1, 2, 3, 4])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 2 if fixed else 5)

    @parameterized.parameters(True, False)
    def test_a_refusal_inside_the_step_is_one_line_only_with_the_fix(self, fixed):
        strategy = self.strategy("mirrored", 2)  # Installs the fixes.
        if not fixed:
            keras_fixes.uninstall(("run_time_refusals",))
        with strategy.scope():
            model = RefusesBatchesOfMoreThanFour([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        data = tf.data.Dataset.from_tensor_slices((tf.ones((12, 3)), tf.ones((12, 1))))
        if fixed:
            with self.assertRaisesRegex(errors.ConfigError,
                                        r"^a batch of more than 4 examples\.$"):
                model.fit(data.batch(10), verbose=0)
        else:
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                        "(?s)Graph execution error.*a batch of more"):
                model.fit(data.batch(10), verbose=0)

    def test_removing_one_of_two_fixes_on_one_method_keeps_the_other(self):
        strategy = self.strategy("mirrored", 2)  # Installs the fixes.
        keras_fixes.uninstall(("multi_step_train_function",))
        with strategy.scope():
            model = RefusesBatchesOfMoreThanFour([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        data = tf.data.Dataset.from_tensor_slices((tf.ones((12, 3)), tf.ones((12, 1))))
        with self.assertRaisesRegex(errors.ConfigError, r"^a batch of more than 4 examples\.$"):
            model.fit(data.batch(10), verbose=0)

    def test_uneven_first_batch_trains_with_the_fix(self):
        history = fit_first_batch_of_five(self.strategy("mirrored", 2))
        self.assertTrue(np.isfinite(history.history["loss"][0]))

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_multi_worker_fit_stops_after_one_step_without_the_log_fix(self):
        reference = testing.tiny_model()
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        np.savez(initial, *reference.get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, WORKER, "multi_worker", initial,
                                  os.path.join(self.get_temp_dir(), "final.npz"), "{}",
                                  "reduce_per_replica"], 2, out=out)
        self.assertNotEqual(status, 0)
        self.assertIn("Invalid reduction dimension 0 for input with 0 dimensions", out.getvalue())
        # With the fix, the same job trains: tests/cluster/strategy_test.py.

    # Without the train function's fix fit fails; without the test function's, evaluate.
    @parameterized.parameters("multi_step_train_function", "multi_step_test_function")
    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_several_steps_per_call_fail_across_workers_without_the_fix(self, fix):
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        np.savez(initial, *testing.tiny_model().get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, WORKER, "multi_worker_allreduce", initial,
                                  os.path.join(self.get_temp_dir(), "final.npz"),
                                  '{"steps_per_execution": 2}', fix], 2, out=out)
        self.assertNotEqual(status, 0)
        self.assertIn("You must feed a value for placeholder tensor", out.getvalue())
        # With the fix, the same job trains exactly: tests/cluster/strategy_test.py.

    def fit_as_if_across_workers(self, name):
        """Fits a model with two scalar logs under ``name`` on 2 devices, with the log fix
        treating the replicas as workers; returns its logs and the strategy.reduce calls."""
        strategy = self.strategy(name, 2)
        with strategy.scope():
            model = testing.tiny_model()
            model.compile(optimizer="sgd", metrics=[keras.metrics.SparseCategoricalAccuracy()],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = model.get_weights()
        reduce, traced_reductions = strategy.reduce, []

        def counted_reduce(*args, **kwargs):
            # Those of the logs (TensorFlow's reads of metric variables reduce too).
            if sys._getframe(1).f_code.co_filename == scalar_logs.__file__:
                traced_reductions.append(args[0])
            return reduce(*args, **kwargs)

        with mock.patch.object(fix, "several_workers", return_value=True), \
                mock.patch.object(strategy, "reduce", counted_reduce):
            across = model.fit(testing.tiny_dataset(16), verbose=0, shuffle=False).history
        model.set_weights(initial)
        model.compile(optimizer="sgd", metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        within = model.fit(testing.tiny_dataset(16), verbose=0, shuffle=False).history
        return across, within, len(traced_reductions)

    def test_scalar_logs_of_workers_are_reduced_in_one_collective(self):
        # Keras's step: the loss and the accuracy, averaged across replicas together (traced
        # once), to the values Keras's own reduction within one worker gives.
        across, within, reductions = self.fit_as_if_across_workers("mirrored")
        self.assertEqual(reductions, 1)
        self.assertAllClose(within, across)

    def test_logs_of_the_all_reduce_step_are_not_reduced_again(self):
        # They are the global batch's on every replica already.
        across, within, reductions = self.fit_as_if_across_workers("allreduce")
        self.assertEqual(reductions, 0)
        self.assertAllClose(within, across)

    def test_the_fixes_wrap_keras_own_code(self):
        keras_fixes.uninstall()
        trainer = fix.tf_trainer_class()  # TensorFlowTrainer to Keras 3.15, Trainer in 3.16.
        self.assertIs(trainer, keras.Model.__mro__[1])
        originals = (trainer._maybe_symbolic_build, keras_tf_trainer.reduce_per_replica)
        keras_fixes.install()
        keras_fixes.install()  # Idempotent: wrapped once.
        self.assertIs(trainer._maybe_symbolic_build.__wrapped__, originals[0])
        self.assertIs(keras_tf_trainer.reduce_per_replica.__wrapped__, originals[1])
        keras_fixes.uninstall()
        self.assertIs(keras_tf_trainer.reduce_per_replica, originals[1])
        self.assertFalse(keras_fixes.installed())

    def test_a_fix_whose_target_is_missing_or_changed_says_so_in_one_line(self):
        keras_fixes.uninstall()

        def moved():  # What Keras 3.16 did to the class that runs fit's step.
            raise AttributeError("module 'keras.src.backend.tensorflow.trainer' has no "
                                 "attribute 'TensorFlowTrainer'")

        first, second, *rest = keras_fixes.FIXES
        missing = dataclasses.replace(first, owner=moved)
        changed = dataclasses.replace(second, parameters=("values", "strategy", "axis"))
        with mock.patch.object(keras_fixes, "FIXES", (missing, changed, *rest)), \
                mock.patch.object(keras_fixes, "_said_unavailable", set()), \
                mock.patch.dict(os.environ, {keras_fixes.MODE_ENV: "force"}), \
                self.assertLogs(level="WARNING") as logs:
            keras_fixes.install()
            keras_fixes.install()  # Said once.
            active = keras_fixes.status()["active"]
        self.assertLen(logs.output, 2)
        self.assertIn("'symbolic_build'", logs.output[0])
        self.assertIn("its target is missing (module 'keras.src.backend.tensorflow.trainer' "
                      "has no attribute 'TensorFlowTrainer')", logs.output[0])
        self.assertIn("Upstream: keras-team/keras#20585", logs.output[0])
        self.assertIn("read against Keras 3.0 to 3.15 and 3.16.0.dev2026102704; this is Keras "
                      f"{keras.version()}.", logs.output[0])
        self.assertIn("'reduce_per_replica'", logs.output[1])
        self.assertIn("takes (values, strategy, reduction), not (values, strategy, axis, ...)",
                      logs.output[1])
        self.assertStartsWith(active["symbolic_build"], "no: its target is missing")
        self.assertStartsWith(active["reduce_per_replica"], "no: ")
        self.assertEqual({name for name, state in active.items() if state == "yes"},
                         {f.name for f in rest})
        for name in {f.name for f in rest}:  # The others are installed.
            self.assertIn(name, keras_fixes._originals)

    def test_only_strategies_of_several_replicas_install_them(self):
        keras_fixes.uninstall()
        strategies.get("default")
        strategies.get("one_device")
        self.assertFalse(keras_fixes.installed())
        self.strategy("mirrored", 2)
        self.assertTrue(keras_fixes.installed())

    def test_an_unverified_keras_is_left_alone_with_a_warning(self):
        keras_fixes.uninstall()
        with mock.patch.object(keras_fixes.keras, "version", return_value="3.99.0"), \
                mock.patch.object(keras_fixes, "_skipped", []), \
                mock.patch.dict(os.environ, {keras_fixes.MODE_ENV: ""}), \
                self.assertLogs(level="WARNING") as logs:
            keras_fixes.install()
            self.assertFalse(keras_fixes.installed())
            self.assertIn("Keras 3.99.0 is outside the versions they were verified against "
                          "(3.0 to 3.15", keras_fixes.status()["applied"])
        self.assertIn("not applied", logs.output[0])
        with mock.patch.object(keras_fixes.keras, "version", return_value="3.99.0"), \
                mock.patch.dict(os.environ, {keras_fixes.MODE_ENV: "force"}):
            keras_fixes.install()
            self.assertTrue(keras_fixes.installed())


BACKUP_FIXES = ("backup_chief_writes", "backup_chief_deletes", "backup_epoch_count",
                "backup_state_beyond_weights")


class RefusesBatchesOfMoreThanFour(keras.Sequential):
    """A step that refuses what only its data reveals, as tfpar's all-reduce step does."""

    def train_step(self, data):
        x, _ = data
        with tf.control_dependencies([tf.debugging.assert_less_equal(
                tf.shape(x)[0], 2, message=errors.RUN_TIME_REFUSAL + "a batch of more than 4 "
                "examples.")]):
            return super().train_step(data)


class WorkerModel:
    """What BackupAndRestore asks of its model, on a worker that is not the chief: it records
    where the weights are saved."""

    built = True
    optimizer = None
    variables = trainable_variables = non_trainable_variables = weights = ()

    def __init__(self):
        self.saved_to = []
        self.distribute_strategy = mock.Mock(**{"extended.should_checkpoint": False,
                                                "num_replicas_in_sync": 2})

    def save_weights(self, filepath, overwrite=True):
        self.saved_to.append(filepath)
        with open(filepath, "w") as f:
            f.write("weights")


class BackupAndRestoreTest(tf.test.TestCase, parameterized.TestCase):
    """Keras's BackupAndRestore across workers, and the epochs it records (the launcher tests
    restart a 2-worker job with it and check its final weights)."""

    def setUp(self):
        super().setUp()
        keras_fixes.install(BACKUP_FIXES)

    def tearDown(self):
        keras_fixes.install(BACKUP_FIXES)
        super().tearDown()

    def new_dir(self):
        path = os.path.join(self.get_temp_dir(), f"backup_{len(os.listdir(self.get_temp_dir()))}")
        os.makedirs(path)
        return path

    def epoch_recorded(self, backup_dir, epochs_batches):
        """Runs the callback through (epoch, batches) and returns the epoch it saved last."""
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        callback = keras.callbacks.BackupAndRestore(backup_dir, save_freq=2,
                                                    delete_checkpoint=False)
        callback.set_model(model)
        callback.set_params({"steps": 4, "epochs": 4})
        for epoch, batches in epochs_batches:
            callback.on_epoch_begin(epoch)
            for batch in range(batches):
                callback.on_train_batch_end(batch)
            if batches == 4:
                callback.on_epoch_end(epoch)
        with open(os.path.join(backup_dir, "training_metadata.json")) as f:
            return json.load(f)["epoch"]

    @parameterized.parameters(True, False)
    def test_the_epochs_finished_are_recorded(self, fixed):
        if not fixed:
            keras_fixes.uninstall(BACKUP_FIXES)
        # Saved after epoch 0's last batch: resumed, training starts at epoch 1 (Keras: 0,
        # so epoch 0 ran again).
        self.assertEqual(self.epoch_recorded(self.new_dir(), [(0, 4)]),
                         1 if fixed else 0)
        # A run resumed at epoch 2, saved mid-epoch: epoch 2 starts again (Keras: epoch 0).
        self.assertEqual(self.epoch_recorded(self.new_dir(), [(2, 2)]),
                         2 if fixed else 0)

    @parameterized.parameters(True, False)
    def test_a_worker_that_is_not_the_chief_leaves_the_backup_alone(self, fixed):
        if not fixed:
            keras_fixes.uninstall(BACKUP_FIXES)
        backup_dir = self.new_dir()
        with open(os.path.join(backup_dir, "latest.weights.h5"), "w") as f:
            f.write("the chief's")
        callback = keras.callbacks.BackupAndRestore(backup_dir)
        model = WorkerModel()
        callback.set_model(model)
        callback.on_epoch_end(0)
        with open(os.path.join(backup_dir, "latest.weights.h5")) as f:
            self.assertEqual(f.read(), "the chief's" if fixed else "weights")
        self.assertLen(model.saved_to, 1)
        self.assertEqual(os.path.dirname(model.saved_to[0]) != backup_dir, fixed)
        if fixed:  # The scratch folder is gone.
            self.assertFalse(os.path.exists(os.path.dirname(model.saved_to[0])))
        callback.on_train_end()
        self.assertEqual(os.path.exists(backup_dir), fixed)


    def backed_up_twice(self):
        """A backup folder after two saves (generations 1 and 2; 1 is removed at 2's commit),
        the weights of generation 1, and a restore into a fresh model of the same build."""
        backup_dir = self.new_dir()

        def model_and_callback():
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            callback = keras.callbacks.BackupAndRestore(backup_dir, save_freq=1,
                                                        delete_checkpoint=False)
            callback.set_model(model)
            return model, callback

        model, callback = model_and_callback()
        callback.set_params({"steps": 4, "epochs": 1})
        callback.on_epoch_begin(0)
        callback.on_train_batch_end(0)
        with open(os.path.join(backup_dir, "generation-1.weights.h5"), "rb") as f:
            first = f.read()
        model.layers[0].kernel.assign(model.layers[0].kernel + 1.0)
        callback.on_train_batch_end(1)

        def restore():
            fresh, fresh_callback = model_and_callback()
            fresh_callback.on_train_begin()
            return fresh

        return backup_dir, first, model, restore

    def test_a_backup_restores_the_weights_its_metadata_names(self):
        _, _, model, restore = self.backed_up_twice()
        self.assertAllEqual(restore().layers[0].kernel, model.layers[0].kernel)

    def test_the_weights_of_another_generation_are_refused_naming_the_file(self):
        # Before, generation 1's weights under generation 2's name were loaded silently.
        backup_dir, first, _, restore = self.backed_up_twice()
        weights = os.path.join(backup_dir, "generation-2.weights.h5")
        with open(weights, "wb") as f:
            f.write(first)
        with self.assertRaisesRegex(DamagedStateError, re.escape(
                f"The backup's file {weights} that {backup_dir}/training_metadata.json names is "
                "not the one its save wrote (another save's, or changed since).")):
            restore()

    @parameterized.parameters(("cut", "OSError"), ("emptied", "OSError"),
                              ("deleted", "no such file"))
    def test_damaged_weights_are_one_error_naming_the_file(self, damage, received):
        # Before: h5py's OSError, a traceback.
        backup_dir, _, _, restore = self.backed_up_twice()
        weights = os.path.join(backup_dir, "generation-2.weights.h5")
        metadata = os.path.join(backup_dir, "training_metadata.json")
        if damage == "deleted":
            os.remove(weights)
        else:
            with open(weights, "r+b") as f:
                f.truncate(os.path.getsize(weights) // 2 if damage == "cut" else 0)
            # Held to its digest, a damaged file is refused before h5py opens it; without
            # one (a save of an earlier version), h5py's error is.
            with open(metadata) as f:
                content = json.load(f)
            del content["tfpar_weights_sha256"]
            with open(metadata, "w") as f:
                json.dump(content, f)
        with self.assertRaisesRegex(DamagedStateError,
                                    f"The backup's file {re.escape(weights)} .*Received: "
                                    f"{received}"):
            restore()

    @parameterized.parameters("folder", "unreadable")
    def test_weights_that_cannot_be_opened_are_one_error_naming_the_file(self, damage):
        # Before: the digest's open raised IsADirectoryError (a folder where the weights file
        # should be), a traceback and not DamagedStateError.
        backup_dir, _, _, restore = self.backed_up_twice()
        weights = os.path.join(backup_dir, "generation-2.weights.h5")
        os.remove(weights)
        if damage == "folder":
            os.makedirs(weights)
        else:  # A name that cannot be opened (root reads any mode): a dangling symlink loop.
            os.symlink(weights, weights)
        with self.assertRaisesRegex(DamagedStateError,
                                    f"The backup's file {re.escape(weights)} .*Received: "):
            restore()

    @parameterized.parameters("training_metadata.json", "generation-2.weights.h5")
    def test_a_kill_while_the_backup_is_deleted_at_the_end_is_not_a_damaged_backup(self, first):
        # Keras deletes the backup folder at the end of training with rmtree, file by file in
        # the folder's order: a kill after its first removal left the metadata without its
        # weights, or the weights without the metadata, and every rerun exited 2 on "damaged".
        backup_dir, _, model, restore = self.backed_up_twice()
        callback = keras.callbacks.BackupAndRestore(backup_dir)
        callback.set_model(model)

        def killed_inside(path, *args, **kwargs):
            if not os.path.isdir(path):
                return
            os.remove(os.path.join(path, first))
            raise KeyboardInterrupt("killed inside the deletion")

        with mock.patch("shutil.rmtree", killed_inside), \
                mock.patch("keras.src.utils.file_utils.rmtree", killed_inside):
            with contextlib.suppress(KeyboardInterrupt):
                callback.on_train_end()
        restore()  # Starts over, or resumes the last save: never refused.

    def test_metadata_missing_beside_a_committed_generation_is_refused(self):
        # Generation 2 is written after the metadata named generation 1: without the metadata,
        # Keras started over without a word.
        backup_dir, _, _, restore = self.backed_up_twice()
        metadata = os.path.join(backup_dir, "training_metadata.json")
        os.remove(metadata)
        with self.assertRaisesRegex(DamagedStateError, re.escape(
                f"The backup's file {metadata} is missing, beside the weights of a committed "
                "save (generation-2.weights.h5).")):
            restore()

    @parameterized.parameters("cut", "emptied")
    def test_damaged_metadata_is_one_error_naming_the_file(self, damage):
        # Before: Keras's json.loads raised JSONDecodeError, a traceback.
        backup_dir, _, _, restore = self.backed_up_twice()
        metadata = os.path.join(backup_dir, "training_metadata.json")
        with open(metadata, "r+b") as f:
            f.truncate(os.path.getsize(metadata) // 2 if damage == "cut" else 0)
        with self.assertRaisesRegex(DamagedStateError,
                                    f"The backup's file {re.escape(metadata)} is not readable. "
                                    "A restore reads a backup as its save wrote it"):
            restore()


class BackupAndRestoreCopiesAdviceTest(testing.StrategyTestCase):
    """What a damaged replicas' copies file of a backup tells the user to do."""

    # Found in review, not fixed: tfpar.replica_copies's DamagedStateError gives
    # EpochCheckpoint's advice ("start over (resume=False), or use another model_dir") to a
    # BackupAndRestore user too, who has neither a resume argument nor a model_dir; the
    # backup's own files say "remove the backup folder DIR". The fix threads the saver's
    # advice through replica_copies.read.
    @unittest.expectedFailure
    def test_a_damaged_copies_file_of_a_backup_gives_the_backups_advice(self):
        strategy = self.strategy("mirrored", 2)
        backup_dir = os.path.join(self.get_temp_dir(), "backup_copies_advice")
        rng = np.random.default_rng(0)
        x, y = rng.random((16, 4), dtype=np.float32), rng.random((16, 2), dtype=np.float32)

        def model_and_callback():
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                          keras.layers.BatchNormalization(momentum=0.5),
                                          keras.layers.Dense(2)])
                model.compile(optimizer="sgd", loss="mse")
            return model, keras.callbacks.BackupAndRestore(backup_dir, save_freq=1,
                                                           delete_checkpoint=False)

        model, callback = model_and_callback()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        (path,) = [os.path.join(folder, name) for folder, _, names in os.walk(backup_dir)
                   for name in names if name.endswith(".npz")]
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        fresh, fresh_callback = model_and_callback()
        fresh_callback.set_model(fresh)
        with self.assertRaises(DamagedStateError) as raised:
            fresh_callback.on_train_begin()
        self.assertIn(path, str(raised.exception))
        self.assertNotIn("resume=False", str(raised.exception))
        self.assertIn(f"remove the backup folder {backup_dir}", str(raised.exception))


BACKUP_FIT = """
import os, sys, tempfile, warnings
import numpy as np, keras, tensorflow as tf
from absl import logging
import tfpar
from tfpar import strategies
from tfpar.compat import keras_fixes
warnings.simplefilter("ignore", DeprecationWarning)
if sys.argv[1] == "strategy":  # A strategy of several replicas installs them.
    strategy = strategies.get("mirrored", devices=2)
else:  # The fixes installed directly, no strategy.
    keras_fixes.install()
    strategy = tf.distribute.get_strategy()
    assert "tfpar.strategies.base" not in sys.modules
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
backup = tempfile.mkdtemp()
model.fit(np.ones((16, 4), np.float32), np.ones((16, 1), np.float32), batch_size=4, epochs=2,
          verbose=0, callbacks=[keras.callbacks.BackupAndRestore(
              backup, save_freq=2, delete_checkpoint=False)])
print(sorted(os.listdir(backup)))
"""


class BackupSaverGivenTest(tf.test.TestCase):
    """The fix hands its saving to a saver: every path that installs it gives one, or it is
    left out in one line (it crashed fit with a RuntimeError)."""

    def test_every_path_that_installs_the_fix_gives_it_a_saver_or_leaves_it_out(self):
        for path, files, said in (
                ("strategy", "'generation-4.weights.h5', 'position.json'", ""),
                ("direct", "'latest.weights.h5'", "no saver was given to hand its saving to")):
            result = subprocess.run([sys.executable, "-c", BACKUP_FIT, path],
                                    capture_output=True, text=True, timeout=300)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            self.assertIn(files, result.stdout)
            self.assertNotIn("Traceback", result.stderr)
            if said:
                self.assertIn(said, result.stderr)


class OneFixPerModuleTest(tf.test.TestCase):

    def test_each_fix_module_names_its_upstream_versions_and_failing_test(self):
        package = os.path.dirname(keras_fixes.__file__)
        root = os.path.dirname(os.path.dirname(os.path.dirname(package)))
        registered = []
        for name in sorted(os.listdir(package)):
            if not name.endswith(".py") or name in ("__init__.py", "fix.py"):
                continue
            module = importlib.import_module(f"tfpar.compat.keras_fixes.{name[:-3]}")
            doc = module.__doc__ or ""
            self.assertRegex(doc, r"^Fix: ", name)
            self.assertRegex(doc, r"Upstream: ", name)
            self.assertRegex(doc, r"Checked on\s+Keras 3\.\d+", name)
            tests = re.findall(r"Fails without it:\s+``(tests/[\w/]+\.py)``", doc)
            self.assertLen(tests, 1, name)
            self.assertTrue(os.path.exists(os.path.join(root, tests[0])), tests[0])
            registered += [fix.name for fix in module.FIXES]
        # Every module's fixes are in the registry; the registry's others are mid_epoch_resume's.
        self.assertCountEqual([f.name for f in keras_fixes.FIXES],
                              [*registered, "mid_epoch_start"])


if __name__ == "__main__":
    tf.test.main()
