"""Tests of EpochCheckpoint: what it refuses to save and to read (resume: end_to_end)."""

import contextlib
import io
import os
import re
import time
import unittest
import warnings
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfpar import testing
from tfpar import worker_contract
from tfpar.callbacks import checkpointing
from tfpar.cli import common
from tfpar.errors import ConfigError
from tfpar.errors import DamagedStateError
from tfpar.errors import PeerLostError
from tfpar.errors import StateNotSavedError


def batchnorm_model() -> keras.Model:
    """A model whose replicas' BatchNorm statistics drift apart (saved beside the checkpoint)."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(momentum=0.5)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def end_epoch(checkpoint: checkpointing.EpochCheckpoint, epoch: int, logs: dict) -> None:
    """An epoch's end as fit ends it, its save committed (as the end of fit waits for it)."""
    checkpoint.on_epoch_end(epoch, logs)
    checkpoint.wait()


class EpochCheckpointTest(testing.StrategyTestCase):

    def saved_once(self) -> tuple[str, checkpointing.EpochCheckpoint]:
        """A folder and a checkpoint of a model on 2 devices that saved epoch 1."""
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy)
        checkpoint.set_model(model)
        end_epoch(checkpoint, 0, {"loss": 1.5})
        return directory, checkpoint

    def test_the_chief_declares_its_folder_and_commits_each_saves_position(self):
        spec = os.path.join(self.get_temp_dir(), "spec.json")
        with mock.patch.dict(os.environ, {worker_contract.WORKER_SPEC_ENV: spec}), \
                mock.patch.dict(worker_contract._declared, clear=True):
            directory, checkpoint = self.saved_once()
            self.assertIsNone(worker_contract.WorkerSpec.read(spec))  # Declared at a restore.
            latest = os.path.basename(checkpoint.latest)
            self.assertEqual(worker_contract.read_position(directory),
                             worker_contract.Position(1, 0, latest, directory))
            self.assertEqual(checkpoint.restore(), 1)
            self.assertEqual(worker_contract.WorkerSpec.read(spec).folder,
                             os.path.abspath(directory))
            before = worker_contract.commits_made()
            checkpoint.save_inside_epoch(1, 3)
            latest = os.path.basename(checkpoint.latest)
            self.assertEqual(worker_contract.read_position(directory),
                             worker_contract.Position(1, 3, latest, directory))
            self.assertEqual(worker_contract.last_committed(before),
                             worker_contract.Position(1, 3, latest, directory))
            self.assertFalse(os.path.exists(os.path.join(directory, "positions.json")))

    def test_saves_every_n_steps_of_an_epoch_but_its_last_and_on_several_steps_per_call(self):
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy,
                                                   save_every_steps=3)
        checkpoint.set_model(model)
        checkpoint.set_params({"steps": 9})
        saved = []
        with mock.patch.object(checkpoint, "_save_or_raise",
                               side_effect=lambda epoch, steps, background=False:
                               saved.append((epoch, steps))):
            checkpoint.on_train_begin()
            checkpoint.on_epoch_begin(1)
            for batch in range(9):  # Steps 3 and 6; 9 is the epoch's end.
                checkpoint.on_train_batch_end(batch, {"loss": 1.0})
            checkpoint.on_epoch_begin(2)
            for batch in (1, 3, 5, 7):  # Two steps per call: 2, 4 (past 3), 6, 8 (past 6).
                checkpoint.on_train_batch_end(batch, {"loss": 1.0})
            checkpoint.on_train_batch_end(8, {"loss": float("nan")})
        self.assertEqual(saved, [(1, 3), (1, 6), (2, 4), (2, 6)])

    def test_auto_times_steps_and_a_save_then_saves_within_the_budget(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        now = [0.0]
        saved = []

        def save(epoch, steps, background=False):  # A save takes 0.1 s, within the step.
            now[0] += 0.1
            saved.append((epoch, steps))
            return False

        with mock.patch("time.perf_counter", lambda: now[0]):
            checkpoint = checkpointing.EpochCheckpoint(
                self.get_temp_dir(), model, strategy, save_every_steps="auto")
        checkpoint.set_model(model)
        checkpoint.set_params({"steps": 20})
        out = io.StringIO()
        with mock.patch.object(checkpoint, "_save_or_raise", side_effect=save), \
                contextlib.redirect_stdout(out):
            checkpoint.on_train_begin()
            checkpoint.on_epoch_begin(0)
            for batch in range(20):  # A step takes 1 s.
                now[0] += 1.0
                checkpoint.on_train_batch_end(batch, {"loss": 1.0})
        # A save after each timed call (the first call is not timed) until 3 saves are timed
        # (the first builds what later saves reuse): 0.1 s / (2% of 1 s) is every 5 steps,
        # from the last save (not the next multiple of 5).
        self.assertEqual(saved, [(0, 2), (0, 3), (0, 4), (0, 9), (0, 14), (0, 19)])
        self.assertEqual(checkpoint.interval, 5)
        self.assertEqual(out.getvalue(), checkpoint.interval_chosen + "\n")
        self.assertEqual(checkpoint.interval_chosen,
                         "Saving every 5 step(s) inside an epoch: a save written within the "
                         "step took 0.1 s and a step 1 s, so these saves cost 2% of the "
                         "training time (budget 2%).")

    def test_auto_on_epochs_too_short_to_save_inside_chooses_from_epochs_end_saves(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        now = [0.0]
        with mock.patch("time.perf_counter", lambda: now[0]):
            checkpoint = checkpointing.EpochCheckpoint(
                self.get_temp_dir(), model, strategy, save_every_steps="auto")
        checkpoint.set_model(model)
        checkpoint.set_params({"steps": 3, "verbose": 1})
        inside, out = [], io.StringIO()

        def save(epochs, steps, background=False):  # An epoch's end save takes 0.5 s.
            if steps:
                inside.append((epochs, steps))
            now[0] += 0.5
            return False

        with mock.patch.object(checkpoint, "_save_or_raise", side_effect=save), \
                contextlib.redirect_stdout(out):
            checkpoint.on_train_begin()
            for epoch in range(3):
                checkpoint.on_epoch_begin(epoch)
                for batch in range(3):
                    now[0] += 1.0
                    checkpoint.on_train_batch_end(batch, {"loss": 1.0})
                end_epoch(checkpoint, epoch, {"loss": 1.0})
        # Timed in the first two epochs, at their second steps, and at the first epoch's end;
        # then at epochs' ends only.
        self.assertEqual(inside, [(0, 2), (1, 2)])
        self.assertEqual(checkpoint.interval, 25)  # 0.5 / (2% of 1 s).
        # On a line of its own after Keras's progress bar (verbose=1).
        self.assertEqual(out.getvalue(),
                         "\nSaving at epochs' ends only: a save written within the step took "
                         "0.5 s and a step 1 s, so the most frequent saves within the budget of "
                         "2% of the training time come every 25 steps, and an epoch has 3.\n")

    def test_auto_in_a_real_fit_says_its_interval_and_saves_inside_the_epoch(self):
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy,
                                                   save_every_steps="auto", save_budget=0.5)
        data = tf.data.Dataset.from_tensor_slices(
            (np.zeros((96, 18, 18, 1), np.float32), np.zeros((96,), np.int64))).batch(8)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            # Nothing of a run reads the name kept for 0.3.0's file.
            warnings.filterwarnings("error", message=r"EpochCheckpoint\.POSITIONS_FILE")
            model.fit(data, epochs=1, verbose=0, callbacks=[checkpoint])
        with self.assertWarnsRegex(DeprecationWarning, r"^EpochCheckpoint\.POSITIONS_FILE is "
                                   r"deprecated and will be removed in tfpar 0\.5\.0: .*"
                                   r"tfpar\.worker_contract\.read_position"):
            self.assertEqual(checkpointing.EpochCheckpoint.POSITIONS_FILE, "positions.json")
        self.assertRegex(out.getvalue(), r"^Saving (every \d+ step\(s\) inside an epoch|at "
                                         r"epochs' ends only): ")
        self.assertEqual(out.getvalue().count("\n"), 1)
        self.assertGreaterEqual(checkpoint.interval, 1)
        # The saves timed for the first choice, one after each timed call (not the first).
        for steps in (2, 3, 4):
            self.assertIn((0, steps), checkpoint._known.values())

    def test_auto_times_both_ways_of_writing_in_a_real_fit_then_writes_the_cheaper(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                                   save_every_steps=1)
        ways, said_before, save = [], [], checkpoint._save_or_raise

        data = tf.data.Dataset.from_tensor_slices(
            (np.zeros((96, 18, 18, 1), np.float32), np.zeros((96,), np.int64))).batch(8)
        with self.assertLogs(level="INFO") as logs:

            def recorded(*args, **kwargs):
                ways.append(save(*args, **kwargs))
                said_before.append(sum("Writing saves " in line for line in logs.output))
                return ways[-1]

            with mock.patch.object(checkpoint, "_save_or_raise", recorded):
                model.fit(data, epochs=1, verbose=0, callbacks=[checkpoint])
        # Within the step (the first, timed whole), in the background, within again (the
        # first is the slowest), then the cheaper way, said as the save written so is made.
        self.assertEqual(ways[:3], [False, True, False])
        self.assertEqual(said_before[:3], [0, 0, 0])
        said = [line for line in logs.output if "Writing saves " in line]
        for count, line in enumerate(said, 1):
            self.assertEqual(ways[said_before.index(count)],
                             "Writing saves in the background:" in line, line)
        self.assertRegex(said[0], r"Writing saves (in the background|within the step): a save "
                                  r"(written within the step took [0-9.e-]+ s \(in the "
                                  r"background it cost [0-9.e-]+ s\)|written in the background "
                                  r"held the step [0-9.e-]+ s and its write took [0-9.e-]+ s on "
                                  r"the cores the step runs on \(the steps beside it slowed by "
                                  r"[0-9.e-]+ s; within the step a save took [0-9.e-]+ s\))\.$")
        self.assertEqual(checkpoint.restore(), 1)

    def test_a_bad_save_interval_or_budget_is_one_line(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        for bad in (-1, 2.5, True, "often"):
            with self.assertRaisesRegex(ConfigError, r"^save_every_steps must be an integer >= 0 "
                                                     r".* or 'auto'\. Received: "):
                checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                              save_every_steps=bad)
        for bad in (0, 1, 1e-320, True, "2%"):
            with self.assertRaisesRegex(ConfigError, r"^save_budget must be a fraction of the "
                                                     r"training time from 0\.0001 to below 1"):
                checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                              save_every_steps="auto", save_budget=bad)
        with self.assertRaisesRegex(ConfigError, r"^write_in_background must be True \(in the "
                                                 r"background\), False \(within the step\) or "
                                                 r"'auto' \(the cheaper, timed on this run\)\. "
                                                 r"Received: write_in_background='yes'\.$"):
            checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                          write_in_background="yes")
        with self.assertRaisesRegex(ConfigError, r"^save_budget applies only with "
                                                 r"save_every_steps='auto'\. Received: "
                                                 r"save_every_steps=5\.$"):
            checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                          save_every_steps=5, save_budget=0.05)

    def test_a_diverged_epoch_is_not_saved(self):
        directory, checkpoint = self.saved_once()
        finite = tf.train.latest_checkpoint(directory)
        with self.assertLogs(level="WARNING") as logs:
            end_epoch(checkpoint, 1, {"loss": float("nan")})
        self.assertIn("Not saving epoch 2: its loss is nan", logs.output[0])
        # The last finite epoch stays the resume point.
        self.assertEqual(tf.train.latest_checkpoint(directory), finite)
        self.assertEqual(checkpoint.restore(), 1)

    def fit_saving_every_two_steps(self, write, during=None):
        """A fit of 8 steps on 2 devices, saving every 2 steps, whose TensorFlow writes go
        through ``write(number, original)``; the steps trained while a write was in flight
        are appended to ``during``. Returns its checkpoint."""
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = batchnorm_model()
        checkpoint = checkpointing.EpochCheckpoint(self.get_temp_dir(), model, strategy,
                                                   save_every_steps=2, write_in_background=True)
        original, writing = checkpoint._saved_even_if_not_swept, []
        during = [] if during is None else during

        def watched(number):
            writing.append(number)
            try:
                return write(number, original)
            finally:
                writing.remove(number)

        watch = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: during.append(batch) if writing else None)
        with mock.patch.object(checkpoint, "_saved_even_if_not_swept", watched):
            model.fit(np.random.rand(32, 4).astype("float32"),
                      np.random.rand(32, 3).astype("float32"), batch_size=4, epochs=1,
                      verbose=0, shuffle=False, callbacks=[checkpoint, watch])
        return checkpoint

    def test_a_save_is_written_while_training_goes_on(self):
        # The first save's write is held until training has taken two more steps: it can
        # only end so if the step did not wait for it (else after 60 s, no step seen).
        during: list[int] = []

        def held(number, original):
            deadline = time.monotonic() + 60
            while number == 2 and len(during) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            return original(number)

        checkpoint = self.fit_saving_every_two_steps(held, during)
        # The save after step 2 (batch 1) was being written through step 3 (batch 2).
        self.assertEqual(during[:2], [1, 2])
        self.assertEqual(checkpoint.restore(), 1)  # fit ended with its last save committed.

    def test_a_write_that_fails_in_the_background_is_raised_by_the_next_save(self):
        def full_disk(number, original):
            if number == 2:
                raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
            return original(number)

        with self.assertRaisesRegex(StateNotSavedError, r"^Could not save the training state "
                                                        r"of epoch 1 step 2 in .* \(No space "
                                                        r"left on device\); no state was saved "
                                                        r"before\."):
            self.fit_saving_every_two_steps(full_disk)

    def test_a_save_that_fails_leaves_the_last_epoch_and_no_partial_folder(self):
        directory, checkpoint = self.saved_once()
        saved = tf.train.latest_checkpoint(directory)
        manager_save = checkpoint._manager.save

        def full_disk(checkpoint_number):  # What SaveV2 does when the disk fills mid-write.
            os.makedirs(os.path.join(directory, f"ckpt-{checkpoint_number}_temp"))
            raise tf.errors.ResourceExhaustedError(
                None, None, f"{directory}/ckpt-2_temp/part-0.data.tempstate1; No space left on "
                "device [Op:SaveV2]")

        checkpoint._manager.save = full_disk
        with self.assertRaises(StateNotSavedError) as raised:
            end_epoch(checkpoint, 1, {"loss": 1.2})
        self.assertEqual(str(raised.exception),
                         f"Could not save the training state of epoch 2 in {directory} (No space "
                         "left on device); the state of epoch 1 is intact. Free space there (or "
                         "make it writable) and run again to resume.")
        self.assertEqual(raised.exception.exit_status, 74)
        self.assertEqual([n for n in os.listdir(directory) if n.endswith("_temp")], [])
        self.assertEqual(tf.train.latest_checkpoint(directory), saved)
        checkpoint._manager.save = manager_save
        self.assertEqual(checkpoint.restore(), 1)
        self.assertEqual(checkpoint.history["loss"], [1.5])

    def test_a_save_whose_old_checkpoints_cannot_be_removed_is_saved_and_said_so(self):
        # TensorFlow commits the save (its index) and then removes older checkpoints: a removal
        # that fails leaves the new save committed, the resume point, not a failed save.
        directory, checkpoint = self.saved_once()

        def cannot_remove(manager):
            raise PermissionError(13, "Permission denied")

        with mock.patch.object(tf.train.CheckpointManager, "_sweep", cannot_remove), \
                self.assertLogs(level="WARNING") as logs:
            end_epoch(checkpoint, 1, {"loss": 1.2})
        self.assertRegex(logs.output[-1], r"Saved ckpt-\d+ in .*, but older checkpoints there "
                                          r"could not be removed \(Permission denied\)")
        self.assertEqual(worker_contract.read_position(directory).pair, (2, 0))
        self.assertEqual(checkpoint.restore(), 2)

    def test_a_save_that_fails_because_a_peer_is_gone_says_so_not_free_space(self):
        # A peer that stopped (its own notice's grace ran out) aborts the save's collectives:
        # the line names the lost peer, as a lost peer during training does (status 69).
        directory, checkpoint = self.saved_once()

        def peer_gone(checkpoint_number):
            raise tf.errors.UnavailableError(
                None, None, "Collective ops is aborted by: The following tasks are unhealthy "
                "(stopped sending heartbeats):\n/job:worker/replica:0/task:1")

        checkpoint._manager.save = peer_gone
        with self.assertRaises(PeerLostError) as raised:
            end_epoch(checkpoint, 1, {"loss": 1.2})
        self.assertEqual(str(raised.exception),
                         "Worker 1 stopped answering, so TensorFlow aborted the job's "
                         "collectives. Check that every worker's process is still running (not "
                         "stopped, killed or out of memory) and the network between the "
                         "workers. The training state of epoch 2 could not be saved; the state "
                         f"of epoch 1 in {directory} is intact and is where a rerun resumes.")
        self.assertEqual((raised.exception.exit_status, raised.exception.unresponsive),
                         (69, (1,)))

    def test_a_save_whose_storage_connection_fails_is_not_a_lost_peer(self):
        # A storage service's connection reset (a bucket's), naming no task and no aborted
        # collective: the state was not saved, but no peer stopped answering (it said "A peer
        # worker stopped answering" and exited 69).
        directory, checkpoint = self.saved_once()

        def storage_reset(checkpoint_number):
            raise tf.errors.UnavailableError(
                None, None, "Error writing gs://bucket/run/ckpt-2.index: Connection reset by "
                "peer")

        checkpoint._manager.save = storage_reset
        with self.assertRaisesRegex(StateNotSavedError, "Connection reset by peer"):
            end_epoch(checkpoint, 1, {"loss": 1.2})

    def test_the_notice_learns_of_a_save_at_its_commit_before_the_clean_up(self):
        # Were the grace budget to run out while old copies are pruned, the notice must
        # already name the state just committed, where the folder resumes.
        directory, checkpoint = self.saved_once()
        seen = []
        before = worker_contract.commits_made()
        with mock.patch.object(checkpoint, "_prune_replica_copies", lambda: seen.extend([
                worker_contract.last_committed(before),
                worker_contract.read_position(directory)])):
            checkpoint.save_inside_epoch(1, 3)
        self.assertEqual([p.where for p in seen], [f"epoch 2 step 3 in {directory}"] * 2)

    def saved_with_copies(self):
        """A folder where a model of 2 replicas with BatchNorm saved epoch 1, the checkpoint's
        replicas' copies file, and a fresh checkpoint of the same build to restore it into."""
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        x = np.random.default_rng(0).random((8, 4), dtype=np.float32)

        def build():
            with strategy.scope():
                model = batchnorm_model()
            model.fit(x, np.ones((8, 3), np.float32), batch_size=8, shuffle=False, verbose=0)
            checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy)
            checkpoint.set_model(model)
            return model, checkpoint

        model, checkpoint = build()
        end_epoch(checkpoint, 0, {"loss": 1.0})
        (written,) = checkpoint.written_by_this_worker
        self.assertEqual(written, "replica_copies/ckpt-1/replicas-00000-00001-of-00002.npz")
        return directory, os.path.join(directory, written), build()[1]

    def test_the_checkpoint_lists_its_copies_files_and_a_missing_one_exits_2_naming_it(self):
        # Before, a missing file was taken as "every replica's copy was the same": the run
        # resumed every replica from the first replica's copy and said nothing.
        directory, path, fresh = self.saved_with_copies()
        self.assertEqual(fresh.restore(), 1)  # Whole, it restores.
        os.remove(path)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
            common.exit_cleanly(lambda argv: fresh.restore())([])
        self.assertEqual(exit_.exception.code, 2)
        self.assertEqual(stderr.getvalue(),
                         f"Error: The replicas' copies file {path} saved with this state is "
                         "missing. A restore reads each file its save wrote, as written; start "
                         "over (resume=False), or use another model_dir. Received: no such "
                         "file.\n")

    def test_a_damaged_copies_file_is_one_error_naming_it(self):
        for damage, error in (("truncated", "BadZipFile"), ("emptied", "EOFError")):
            with self.subTest(damage):
                _, path, fresh = self.saved_with_copies()
                with open(path, "rb") as f:
                    data = f.read()
                with open(path, "wb") as f:
                    f.write(data[:len(data) // 2] if damage == "truncated" else b"")
                with self.assertRaisesRegex(DamagedStateError,
                                            f"copies file {path} is not readable.*Received: "
                                            f"{error}"):
                    fresh.restore()

    def test_a_damaged_checkpoint_file_is_one_error_naming_it(self):
        directory, _ = self.saved_once()
        data = tf.train.latest_checkpoint(directory) + ".data-00000-of-00001"
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        with self.assertRaisesRegex(DamagedStateError,
                                    f"The checkpoint {directory}/ckpt-1 \\(its files "
                                    r"ckpt-1\.index and ckpt-1\.data-\*\) cannot be "
                                    r"restored: they are damaged, or hold another model's "
                                    r"state\..*"
                                    r"Received: \w+Error: "):
            checkpointing.EpochCheckpoint(directory, model, strategy).restore()

    def test_a_checkpoint_of_a_model_with_fewer_variables_is_one_error_naming_it(self):
        # Before: assert_existing_objects_matched's AssertionError, a traceback whose message
        # runs over several lines (the unmatched variables' values), and exit 1.
        directory, _ = self.saved_once()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            # The saved model (testing.tiny_model), and one layer more.
            model = keras.Sequential([keras.Input((18, 18, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(3), keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(DamagedStateError,
                                    f"^The checkpoint {directory}/ckpt-1 \\(its files "
                                    r"ckpt-1\.index and ckpt-1\.data-\*\) cannot be "
                                    r"restored: .*Received: AssertionError: [^\n]*$"):
            checkpointing.EpochCheckpoint(directory, model, strategy).restore()

    def test_an_index_tensorflow_ignores_is_refused_not_started_over(self):
        # TensorFlow ignores an index it cannot parse, or whose checkpoint has no files, and
        # finds no checkpoint: the run started over without a word.
        for damage in ("cut", "checkpoint_files_gone"):
            with self.subTest(damage):
                directory, checkpoint = self.saved_once()
                index = os.path.join(directory, "checkpoint")
                if damage == "cut":
                    with open(index, "r+b") as f:
                        f.truncate(os.path.getsize(index) // 2)
                    message = (f"The checkpoint index {index} is not readable. A restore reads "
                               "a checkpoint as TensorFlow wrote it; start over (resume=False), "
                               "or use another model_dir. Received: ")
                else:
                    os.remove(os.path.join(directory, "ckpt-1.index"))
                    message = (f"The checkpoint {directory}/ckpt-1 that the index {index} names "
                               "has no file ckpt-1.index.")
                self.assertIsNone(checkpoint.latest)
                with self.assertRaisesRegex(DamagedStateError, "^" + re.escape(message)):
                    checkpoint.restore()

    def test_a_folder_in_place_of_the_index_is_refused_not_started_over(self):
        # TensorFlow logs "Is a directory ... Checkpoint ignored" and finds no checkpoint; the
        # check's open raised IsADirectoryError, taken as "no index": tfpar-train said "No
        # saved training state" and trained from scratch over the saved one.
        directory, checkpoint = self.saved_once()
        index = os.path.join(directory, "checkpoint")
        os.remove(index)
        os.makedirs(index)
        self.assertIsNone(checkpoint.latest)
        with self.assertRaisesRegex(DamagedStateError, "^" + re.escape(
                f"The checkpoint index {index} is not readable.")):
            checkpoint.restore()

    def test_a_damaged_made_with_file_is_one_error_naming_it(self):
        # Before: json's JSONDecodeError (cut short), IsADirectoryError (a folder in its place)
        # or AttributeError (not an object): a traceback, and exit 1, which the launcher
        # restarts.
        for damage in ("cut", "folder", "list"):
            with self.subTest(damage):
                directory = os.path.join(self.get_temp_dir(), f"made_with_{damage}")
                strategy = self.strategy("mirrored", 2)
                with strategy.scope():
                    model = testing.tiny_model()
                made_with = {"model": "tiny", "dataset": "digits"}
                checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy,
                                                           made_with=made_with)
                checkpoint.set_model(model)
                end_epoch(checkpoint, 0, {"loss": 1.5})
                path = os.path.join(directory, "made_with.json")
                self.assertTrue(os.path.exists(path))
                if damage == "cut":
                    with open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) // 2)
                elif damage == "folder":
                    os.remove(path)
                    os.makedirs(path)
                else:
                    with open(path, "w") as f:
                        f.write("[]")
                fresh = checkpointing.EpochCheckpoint(directory, model, strategy,
                                                      made_with=made_with)
                with self.assertRaisesRegex(DamagedStateError, "^" + re.escape(
                        f"The file {path} that records what the training state in "
                        f"{directory} was made with is not readable.")):
                    fresh.restore()

    def test_a_position_record_that_is_not_an_object_is_not_a_traceback(self):
        # Before (0.3's positions.json): dict(5) raised TypeError (only OSError and ValueError
        # were caught) in the line that names the resumed position, a traceback and exit 1.
        directory, checkpoint = self.saved_once()
        for name in ("position.json", "positions.json"):
            with open(os.path.join(directory, name), "w") as f:
                f.write("5")
        fresh = checkpointing.EpochCheckpoint(directory, checkpoint._model, checkpoint._strategy)
        self.assertEqual(fresh.restore(), 1)  # The checkpoint holds the position.
        self.assertEqual(fresh.position_of(fresh.latest), "the end of epoch 1")
        # The restore wrote the record of what it restored.
        self.assertEqual(worker_contract.read_position(directory).pair, (1, 0))

    def test_the_resume_line_names_the_checkpoints_own_position_where_the_record_is_stale(self):
        # A kill between TensorFlow's commit of a save and its position record: the record
        # names the save before, so the line (printed before the restore) reads the
        # checkpoint itself, not its number (which counts optimizer steps).
        directory, checkpoint = self.saved_once()
        record = os.path.join(directory, worker_contract.POSITION_FILE)
        with open(record, encoding="utf-8") as f:
            before = f.read()
        checkpoint.save_inside_epoch(1, 3)
        with open(record, "w", encoding="utf-8") as f:
            f.write(before)
        self.assertIsNone(worker_contract.read_position(directory))
        fresh = checkpointing.EpochCheckpoint(directory, checkpoint._model, checkpoint._strategy)
        self.assertEqual(fresh.position_of(fresh.latest), "epoch 2 step 3")
        self.assertEqual(fresh.restore(), 1)
        self.assertEqual(worker_contract.read_position(directory).pair, (1, 3))

    def test_starting_over_leaves_no_record_a_reused_checkpoint_name_could_match(self):
        # A run that does not resume saves from step 0 again, so its checkpoint numbers repeat
        # the old run's: a kill between its first commit and its record must not leave the old
        # run's record naming the new save.
        directory, checkpoint = self.saved_once()
        fresh = checkpointing.EpochCheckpoint(directory, checkpoint._model, checkpoint._strategy)
        self.assertEqual(fresh.start_over(), 0)
        self.assertIsNone(worker_contract.read_position(directory))

    def test_a_save_removes_what_a_save_killed_inside_tensorflows_write_left(self):
        # A kill inside TensorFlow's write leaves ckpt-N_temp/ with a partial data file as
        # large as the state; it was removed only after a save that failed, so every kill
        # left one for good.
        directory, checkpoint = self.saved_once()
        left = os.path.join(directory, "ckpt-7_temp")
        os.makedirs(left)
        with open(os.path.join(left, "part-00000-of-00001.data-00000-of-00001.tempstate1"),
                  "wb") as f:
            f.write(b"partial")
        end_epoch(checkpoint, 1, {"loss": 1.0})
        self.assertFalse(os.path.exists(left))

    # Found in review, not fixed: nothing stops two runs from using one model_dir at once. A
    # second tfpar-train (another --lr) started 3 s after the first resumed from the first's
    # epoch-1 checkpoint while the first still trained, and both saved ckpt-46 and ckpt-69 into
    # the folder, each exiting 0: the folder's state is whichever wrote last, said nowhere.
    # A fix needs a lock the chief holds while it trains (released by a kill), a design
    # change.
    @unittest.expectedFailure
    def test_a_second_run_in_a_folder_in_use_is_refused(self):
        directory, first = self.saved_once()  # The first run, still training.
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        with self.assertRaises(ConfigError):
            checkpointing.EpochCheckpoint(directory, model, strategy).restore()
        end_epoch(first, 1, {"loss": 1.0})

    def test_without_an_index_nothing_was_saved(self):
        # As a kill before a first save's index leaves it: the run starts over.
        directory, checkpoint = self.saved_once()
        os.remove(os.path.join(directory, "checkpoint"))
        self.assertEqual(checkpoint.restore(), 0)

    def test_an_unreadable_checkpoint_index_is_a_clear_error(self):
        model_dir = self.get_temp_dir()
        with open(os.path.join(model_dir, "checkpoint"), "wb") as f:
            f.write(b"\xff\xfe garbage \x00")
        strategy = self.strategy("mirrored", 1)
        with strategy.scope():
            model = testing.tiny_model()
        with self.assertRaisesRegex(ConfigError, r"checkpoint index .*checkpoint is not "
                                                 r"readable"):
            checkpointing.EpochCheckpoint(model_dir, model, strategy)


if __name__ == "__main__":
    tf.test.main()
