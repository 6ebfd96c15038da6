"""Tests of parallel evaluation: equal to single-device accuracy for any replica count."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import models
from tfpar import testing
from tfpar.training import evaluation


class AccuracyTest(testing.StrategyTestCase):

    NUM_DEVICES = 3

    @parameterized.parameters(1, 2, 3)
    def test_equals_single_device_with_uneven_batches(self, num_replicas):
        reference = models.lenet(num_classes=3, input_shape=(18, 18, 1))
        dataset = testing.tiny_dataset(num_examples=23, batch_size=5)  # Last batch: 3.
        images = np.concatenate([x for x, _ in dataset])
        labels = np.concatenate([y for _, y in dataset])
        expected = np.mean(np.argmax(reference.predict(images, verbose=0), -1) == labels)
        strategy = self.strategy("mirrored", num_replicas)
        with strategy.scope():
            model = models.lenet(num_classes=3, input_shape=(18, 18, 1))
        model.set_weights(reference.get_weights())
        self.assertEqual(evaluation.accuracy(model, dataset, strategy), expected)


if __name__ == "__main__":
    tf.test.main()
