"""Tiny deterministic image datasets for distributed-training checks."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def tiny_dataset(num_examples: int = 16, image_shape: tuple[int, int, int] = (18, 18, 1),
                 num_classes: int = 3, batch_size: int = 8, seed: int = 0) -> tf.data.Dataset:
    """Returns ``(image, label)`` batches of random images with fixed labels.

    The same arguments always give the same examples in the same order (no shuffling), so a
    single-device run and a distributed run see identical global batches.

    Args:
        num_examples: Number of examples.
        image_shape: ``(height, width, channels)``; 18x18 is the smallest LeNet accepts.
        num_classes: Labels are ``0 .. num_classes - 1``.
        batch_size: Global batch size; the last batch is smaller if it does not divide.
        seed: Seed of images and labels.

    Returns:
        The batched dataset of ``float32`` images in [0, 1) and ``int32`` labels.
    """
    rng = np.random.default_rng(seed)
    images = rng.random((num_examples, *image_shape), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=num_examples, dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch_size)
