"""Tests of dataset loading: TFDS (mocked), the offline datasets, data_dir errors."""

import contextlib
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfpar.data import catalog
from tfpar.data import loading
from tfpar.errors import DatasetError


def mock_tfds(num_examples):
    """TFDS mock data, with the download site reported reachable (mock downloads are no-ops)."""
    stack = contextlib.ExitStack()
    stack.enter_context(tfds.testing.mock_data(num_examples=num_examples))
    stack.enter_context(mock.patch.object(loading, "_reachable", return_value=True))
    return stack


class TfdsTest(tf.test.TestCase):

    def test_fashion_mnist_through_tfds(self):
        with mock_tfds(num_examples=6):
            splits = loading.load("fashion_mnist", data_dir=self.get_temp_dir())
        self.assertEqual((splits.image_shape, splits.num_classes), ((28, 28, 1), 10))
        self.assertEqual((splits.num_train, splits.num_test), (6, 6))
        image, label = next(iter(splits.train))
        self.assertEqual(image.shape, (28, 28, 1))
        self.assertEqual(image.dtype, tf.float32)
        self.assertBetween(float(tf.reduce_max(image)), 0.0, 1.0)
        self.assertEqual(label.dtype, tf.int32)

    def test_cifar10_downloads_when_not_prepared(self):
        # Mock data has no prepared cifar10 here, so tfpar downloads it (mocked: a no-op) once
        # the download site answers.
        with tfds.testing.mock_data(num_examples=2), \
                mock.patch.object(loading, "_reachable", return_value=True) as reachable:
            splits = loading.load("cifar10")
        reachable.assert_called_once_with("https://www.cs.toronto.edu/")
        self.assertEqual(next(iter(splits.test))[0].shape, (32, 32, 3))

    def test_offline_gives_one_clear_error(self):
        with mock.patch.object(loading, "_reachable", return_value=False):
            with self.assertRaisesRegex(
                    DatasetError, r"Dataset 'fashion_mnist' is not prepared in .*, and its "
                                  r"download site \(fashion-mnist\..*\) cannot be reached\. .*"
                                  r"pass data_dir, or use a dataset that needs no download: "
                                  r"digits, synthetic\."):
                loading.load("fashion_mnist", data_dir=self.get_temp_dir())

    def test_download_off(self):
        with self.assertRaisesRegex(DatasetError, "not prepared in .* and downloading is off"):
            loading.load("mnist", data_dir=self.get_temp_dir(), download=False)

    def test_missing_data_dir(self):
        with self.assertRaisesRegex(DatasetError, r"^data_dir '/no/such/dir' does not exist"):
            loading.load("mnist", data_dir="/no/such/dir")

    def test_unreadable_data_dir(self):
        with tempfile.TemporaryDirectory() as folder, \
                mock.patch.object(catalog.os, "access", return_value=False):
            with self.assertRaisesRegex(DatasetError, "is not readable"):
                loading.load("mnist", data_dir=folder)


class OfflineDatasetsTest(tf.test.TestCase):

    def test_digits_is_real_and_split_fixed(self):
        splits = loading.load("digits")
        self.assertEqual((splits.num_train, splits.num_test), (1437, 360))
        images, labels = next(iter(splits.train.batch(1437)))
        self.assertEqual(images.shape, (1437, 28, 28, 1))
        self.assertAllInRange(images, 0.0, 1.0)
        self.assertCountEqual(np.unique(labels), range(10))
        again = next(iter(loading.load("digits").train.batch(1437)))[1]
        self.assertAllEqual(labels, again)

    def test_synthetic_follows_requested_shape(self):
        splits = loading.load("synthetic", image_shape=(32, 32, 3), num_classes=4,
                           synthetic_size=(10, 5))
        self.assertEqual((splits.num_train, splits.num_test), (10, 5))
        self.assertEqual(next(iter(splits.train))[0].shape, (32, 32, 3))

    def test_unknown_dataset_lists_available(self):
        with self.assertRaisesRegex(DatasetError, r"Unknown dataset 'imagenet'\. Available "
                                                  r"datasets: cifar10, digits, fashion_mnist, "
                                                  r"mnist, synthetic\."):
            loading.load("imagenet")

    def test_image_shape_mismatch(self):
        splits = loading.load("synthetic", image_shape=(32, 32, 3), synthetic_size=(2, 2))
        with self.assertRaisesRegex(DatasetError, r"'synthetic' has images of shape \(32, 32, 3\), "
                                                  r"but the model expects \(28, 28, 1\)"):
            loading.check_image_shape(splits, (28, 28, 1))


class OfflineDataDirTest(tf.test.TestCase):

    def test_data_dir_of_an_offline_dataset_is_reported_unused(self):
        with self.assertLogs(level="WARNING") as logs:
            loading.load("digits", data_dir=self.get_temp_dir())
        self.assertIn("is not used: dataset 'digits' needs no files", logs.output[0])


if __name__ == "__main__":
    tf.test.main()
