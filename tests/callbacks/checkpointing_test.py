"""Tests of EpochCheckpoint: what it refuses to save and to read (resume: end_to_end)."""

import os

import tensorflow as tf

from tfpar import testing
from tfpar.callbacks import checkpointing
from tfpar.errors import ConfigError


class EpochCheckpointTest(testing.StrategyTestCase):

    def test_a_diverged_epoch_is_not_saved(self):
        directory = self.get_temp_dir()
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = testing.tiny_model()
        checkpoint = checkpointing.EpochCheckpoint(directory, model, strategy)
        checkpoint.set_model(model)
        checkpoint.on_epoch_end(0, {"loss": 1.5})
        finite = tf.train.latest_checkpoint(directory)
        with self.assertLogs(level="WARNING") as logs:
            checkpoint.on_epoch_end(1, {"loss": float("nan")})
        self.assertIn("Not saving epoch 2: its loss is nan", logs.output[0])
        # The last finite epoch stays the resume point.
        self.assertEqual(tf.train.latest_checkpoint(directory), finite)
        self.assertEqual(checkpoint.restore(), 1)

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
