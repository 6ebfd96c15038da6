"""Peer: Keras 3 on JAX with ``keras.distribution.DataParallel`` over N CPU devices (Keras's own
data-parallel API), LeNet or the modified ResNet-18 rebuilt in plain Keras layers.

usage: XLA_FLAGS=--xla_force_host_platform_device_count=N KERAS_BACKEND=jax \\
    python keras_jax_dp.py N lenet|resnet18 GLOBAL_BATCH STEPS
Prints ``img/s X`` for one ``fit`` of STEPS steps after warm-up. ``DTYPE=bfloat16``: Keras's
``mixed_bfloat16`` policy.
"""

import os
import sys
import time

import jax
import keras
import numpy as np
from keras import layers


def lenet() -> keras.Model:
    return keras.Sequential([
        keras.Input((28, 28, 1)), layers.Conv2D(20, 3, activation="relu"),
        layers.AveragePooling2D(2), layers.Conv2D(50, 5, activation="relu"),
        layers.AveragePooling2D(2), layers.Flatten(), layers.Dense(128, activation="relu"),
        layers.Dense(10)])


def _norm(x):
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)


def _residual(x, channels: int, strides: int = 1, project: bool = False):
    y = layers.ReLU()(_norm(layers.Conv2D(channels, 3, strides=strides, padding="same")(x)))
    y = _norm(layers.Conv2D(channels, 3, padding="same")(y))
    if project:
        x = layers.Conv2D(channels, 1, strides=strides)(x)
    return layers.ReLU()(layers.Add()([y, x]))


def resnet18() -> keras.Model:
    inputs = keras.Input((28, 28, 1))
    x = layers.ReLU()(_norm(layers.Conv2D(64, 3, padding="same")(inputs)))
    for channels, first in ((64, True), (128, False), (256, False), (512, False)):
        x = _residual(x, channels, 1 if first else 2, not first)
        x = _residual(x, channels)
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))


def main(devices: int, model_name: str, batch: int, steps: int) -> None:
    if os.environ.get("DTYPE", "float32") == "bfloat16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    if devices > 1:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices()[:devices]))
    model = resnet18() if model_name == "resnet18" else lenet()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch)

    def run(count: int) -> None:
        model.fit(np.concatenate([x] * count), np.concatenate([y] * count), batch_size=batch,
                  epochs=1, verbose=0, shuffle=False)

    run(3)
    start = time.perf_counter()
    run(steps)
    print(f"img/s {batch * steps / (time.perf_counter() - start):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
