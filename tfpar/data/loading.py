"""Loading datasets: unbatched train and test splits of images scaled to [0, 1], integer labels.

* ``fashion_mnist`` (the default), ``mnist``, ``cifar10``: TensorFlow Datasets, honouring
  ``data_dir``. Without internet they must already be prepared there.
* ``digits``: the real 8x8 handwritten digits shipped inside scikit-learn, resized to 28x28x1
  with a fixed train/test split; it works on a machine without internet.
* ``synthetic``: random images of any shape, for throughput measurements.

:func:`load` returns unbatched splits (:mod:`.pipelines` batches them by the global batch
size and distributes them). Which datasets exist is in :mod:`.catalog`.
"""

from __future__ import annotations

import dataclasses
import socket
from urllib.parse import urlparse

import numpy as np
import tensorflow as tf
from absl import logging

from tfpar.data import catalog
from tfpar.data.catalog import OFFLINE_DATASETS
from tfpar.data.catalog import TFDS
from tfpar.data.catalog import TfdsInfo
from tfpar.data.catalog import available
from tfpar.errors import DatasetError


@dataclasses.dataclass(frozen=True)
class Splits:
    """A dataset's train and test splits, unbatched, as ``(image float32, label int32)``.

    Attributes:
        name: The dataset name.
        train: Training examples.
        test: Test examples.
        image_shape: ``(height, width, channels)``.
        num_classes: Number of labels.
        num_train: Number of training examples.
        num_test: Number of test examples.
    """

    name: str
    train: tf.data.Dataset
    test: tf.data.Dataset
    image_shape: tuple[int, int, int]
    num_classes: int
    num_train: int
    num_test: int


def load(name: str, data_dir: str | None = None, *, download: bool = True,
         image_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
         synthetic_size: tuple[int, int] = (2048, 512), seed: int = 0) -> Splits:
    """Loads a dataset's train and test splits.

    Args:
        name: One of :func:`available`.
        data_dir: TFDS data directory (TFDS's default when ``None``).
        download: Whether a TFDS dataset missing from ``data_dir`` may be downloaded.
        image_shape: Image shape of ``synthetic`` data.
        num_classes: Number of classes of ``synthetic`` data.
        synthetic_size: ``(train, test)`` example counts of ``synthetic`` data.
        seed: Seed of ``synthetic`` data.

    Returns:
        The :class:`Splits`.

    Raises:
        DatasetError: If the name is unknown, ``data_dir`` is unusable, or the dataset is
            neither prepared nor downloadable.
    """
    if name in OFFLINE_DATASETS and data_dir is not None:
        logging.warning("data_dir=%r is not used: dataset %r needs no files.", data_dir, name)
    if name == "digits":
        return _digits()
    if name == "synthetic":
        return _synthetic(image_shape, num_classes, synthetic_size, seed)
    if name in TFDS:
        return _tfds(name, TFDS[name], data_dir, download)
    raise DatasetError(f"Unknown dataset {name!r}. Available datasets: {', '.join(available())}.")


def _to_image_label(image, label):
    return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)


def _reachable(url: str, timeout: float = 5.0) -> bool:
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _tfds(name: str, info: TfdsInfo, data_dir: str | None, download: bool) -> Splits:
    import tensorflow_datasets as tfds  # Imported lazily: it is slow and not always needed.

    catalog.check_data_dir(data_dir)
    builder = tfds.builder(info.tfds_name, data_dir=data_dir)
    if not builder.is_prepared():
        where = data_dir or "TFDS's default data directory"
        offline_hint = (f"Prepare it there on a machine with internet (python -c \"import "
                        f"tensorflow_datasets as tfds; tfds.load('{info.tfds_name}', "
                        f"data_dir=...)\") and pass {{argument}}, or use a dataset that needs no "
                        f"download: {', '.join(OFFLINE_DATASETS)}.")
        if not download:
            raise DatasetError(f"Dataset {name!r} is not prepared in {where} and downloading is "
                               f"off. {offline_hint}", argument="data_dir")
        if not _reachable(info.download_url):
            raise DatasetError(f"Dataset {name!r} is not prepared in {where}, and its download "
                               f"site ({urlparse(info.download_url).hostname}) cannot be "
                               f"reached. {offline_hint}", argument="data_dir")
        builder.download_and_prepare()
    train, test = builder.as_dataset(split=["train", "test"], as_supervised=True)
    return Splits(name=name, train=train.map(_to_image_label), test=test.map(_to_image_label),
                  image_shape=info.image_shape, num_classes=info.num_classes,
                  num_train=int(train.cardinality()), num_test=int(test.cardinality()))


# A fixed split of scikit-learn's 1,797 digits: shuffled once with this seed, the first 80%
# train. Fixed so that accuracies are comparable between runs and machines.
_DIGITS_SPLIT_SEED = 0
_DIGITS_TRAIN_FRACTION = 0.8


def _digits() -> Splits:
    from sklearn.datasets import load_digits  # Imported lazily: only this dataset needs it.

    digits = load_digits()
    # Pixel values are 0..16; scale to [0, 1] and resize to LeNet's 28x28 input.
    images = (digits.images.astype(np.float32) / 16.0)[..., np.newaxis]
    images = tf.image.resize(images, (28, 28), method="bilinear").numpy()
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels))
    cut = int(len(labels) * _DIGITS_TRAIN_FRACTION)
    train, test = order[:cut], order[cut:]
    return Splits(
        name="digits",
        train=tf.data.Dataset.from_tensor_slices((images[train], labels[train])),
        test=tf.data.Dataset.from_tensor_slices((images[test], labels[test])),
        image_shape=(28, 28, 1), num_classes=10, num_train=len(train), num_test=len(test))


def _synthetic(image_shape, num_classes, sizes, seed) -> Splits:
    rng = np.random.default_rng(seed)

    def make(n):
        images = rng.random((n, *image_shape), dtype=np.float32)
        labels = rng.integers(0, num_classes, size=n, dtype=np.int32)
        return tf.data.Dataset.from_tensor_slices((images, labels))

    return Splits(name="synthetic", train=make(sizes[0]), test=make(sizes[1]),
                  image_shape=tuple(image_shape), num_classes=num_classes,
                  num_train=sizes[0], num_test=sizes[1])


def check_image_shape(splits: Splits, input_shape: tuple[int, ...]) -> None:
    """Raises unless the dataset's images fit a model's input shape.

    Raises:
        DatasetError: If the shapes differ.
    """
    if tuple(splits.image_shape) != tuple(input_shape):
        raise DatasetError(f"Dataset {splits.name!r} has images of shape {splits.image_shape}, "
                           f"but the model expects {tuple(input_shape)}. Build the model with "
                           f"input_shape={splits.image_shape}.")
