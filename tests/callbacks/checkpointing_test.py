"""Tests of EpochCheckpoint: what it refuses to save and to read (resume: end_to_end)."""

import os
from unittest import mock

import tensorflow as tf

from tfpar import testing
from tfpar.callbacks import checkpointing
from tfpar.cluster import protocol
from tfpar.errors import ConfigError
from tfpar.errors import PeerLostError
from tfpar.errors import StateNotSavedError


class EpochCheckpointTest(testing.StrategyTestCase):

    def saved_once(self) -> tuple[str, checkpointing.EpochCheckpoint]:
        """A folder and a checkpoint of a model on 2 devices that saved epoch 1."""
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy)
        checkpoint.set_model(model)
        checkpoint.on_epoch_end(0, {"loss": 1.5})
        return directory, checkpoint

    def test_the_chief_records_where_it_resumed_and_what_it_saved_for_the_launcher(self):
        record = os.path.join(self.get_temp_dir(), "progress.json")
        with mock.patch.dict(os.environ, {protocol.PROGRESS_RECORD_ENV: record}):
            directory, checkpoint = self.saved_once()
            self.assertEqual(protocol.ProgressRecord.read(record),
                             protocol.ProgressRecord(None, (1, 0), directory))
            self.assertEqual(checkpoint.restore(), 1)
            self.assertEqual(protocol.ProgressRecord.read(record),
                             protocol.ProgressRecord((1, 0), None, directory))
            checkpoint.save_inside_epoch(1, 3)
            self.assertEqual(protocol.ProgressRecord.read(record),
                             protocol.ProgressRecord((1, 0), (1, 3), directory))

    def test_a_diverged_epoch_is_not_saved(self):
        directory, checkpoint = self.saved_once()
        finite = tf.train.latest_checkpoint(directory)
        with self.assertLogs(level="WARNING") as logs:
            checkpoint.on_epoch_end(1, {"loss": float("nan")})
        self.assertIn("Not saving epoch 2: its loss is nan", logs.output[0])
        # The last finite epoch stays the resume point.
        self.assertEqual(tf.train.latest_checkpoint(directory), finite)
        self.assertEqual(checkpoint.restore(), 1)

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
            checkpoint.on_epoch_end(1, {"loss": 1.2})
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
            checkpoint.on_epoch_end(1, {"loss": 1.2})
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
            checkpoint.on_epoch_end(1, {"loss": 1.2})

    def test_the_notice_learns_of_a_save_at_its_commit_before_the_clean_up(self):
        # Were the grace budget to run out while old copies are pruned, the notice must
        # already name the state just committed, where the folder resumes.
        directory, checkpoint = self.saved_once()
        seen = []
        with mock.patch.object(checkpointing.preemption, "NOTICE") as notice, \
                mock.patch.object(checkpoint, "_prune_replica_copies",
                                  lambda: seen.extend(notice.saved.call_args_list)):
            checkpoint.save_inside_epoch(1, 3)
        self.assertEqual(seen, [mock.call(f"epoch 2 step 3 in {directory}", (1, 3))])

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
