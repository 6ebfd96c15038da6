"""The datasets tfpar knows by name, with their image shapes and sources (no TensorFlow).

Kept apart from :mod:`tfpar.data` so that the names are known without importing TensorFlow,
e.g. for command-line flags and ``--help``.
"""

from __future__ import annotations

import dataclasses
import os

from tfpar.errors import DatasetError

OFFLINE_DATASETS = ("digits", "synthetic")
"""Work without internet: digits ship inside scikit-learn, synthetic data is generated."""


@dataclasses.dataclass(frozen=True)
class TfdsInfo:
    """Where a TFDS dataset comes from and what its images are."""

    tfds_name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    # Where TFDS downloads from; probed before a download so that an offline machine fails
    # in seconds, not after minutes of TFDS's HTTP retries.
    download_url: str


TFDS = {
    "fashion_mnist": TfdsInfo("fashion_mnist", (28, 28, 1), 10,
                              "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"),
    "mnist": TfdsInfo("mnist", (28, 28, 1), 10, "https://storage.googleapis.com/"),
    "cifar10": TfdsInfo("cifar10", (32, 32, 3), 10, "https://www.cs.toronto.edu/"),
}
"""The TensorFlow Datasets tfpar trains on, by name: image shape and classes."""


def available() -> list[str]:
    """Returns the dataset names :func:`tfpar.data.load` accepts."""
    return sorted([*TFDS, *OFFLINE_DATASETS])


def check_data_dir(data_dir: str | None) -> None:
    """Checks that a TFDS data directory, where one is given, is a folder that can be read.

    Raises:
        DatasetError: If it does not exist, is not a directory or cannot be read.
    """
    if data_dir is None:
        return
    if not os.path.isdir(data_dir):
        raise DatasetError(f"{{argument}} {data_dir!r} does not exist or is not a directory. "
                           "Give an existing directory (TFDS keeps prepared datasets there).",
                           argument="data_dir")
    if not os.access(data_dir, os.R_OK | os.X_OK):
        raise DatasetError(f"{{argument}} {data_dir!r} is not readable. Give a directory you "
                           "can read (and write, to download into it).", argument="data_dir")
