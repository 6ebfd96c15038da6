"""A model built and compiled under a strategy, as the train command and the benchmark need it."""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar import models
from tfpar.strategies import refusals


def build_compiled_model(model_name: str, image_shape: tuple[int, ...], num_classes: int,
                         strategy: tf.distribute.Strategy,
                         make_optimizer: Callable[[], keras.optimizers.Optimizer], *,
                         dtype: str = "float32", jit_compile: bool = False,
                         steps_per_execution: int = 1,
                         sync_batchnorm: bool = False) -> keras.Model:
    """Builds a registered model and compiles it for classification under ``strategy``'s scope.

    The dtype policy is in force while the model is built (layers keep it) and restored after.
    The loss is sparse categorical cross-entropy on logits; the metric is accuracy.

    Args:
        model_name: A name from ``tfpar.models.available()``.
        image_shape: The input images' ``(height, width, channels)``.
        num_classes: Number of labels.
        strategy: The strategy whose scope holds the variables.
        make_optimizer: Returns the optimizer (called inside the scope).
        dtype: Keras dtype policy, e.g. ``"mixed_float16"``.
        jit_compile: Compile the step with XLA.
        steps_per_execution: Steps per compiled call.
        sync_batchnorm: Synchronise BatchNorm statistics across replicas.

    Returns:
        The compiled model.

    Raises:
        RegistryError: For an unknown model, or an option its builder does not take.
    """
    kwargs = {"synchronized_batchnorm": True} if sync_batchnorm else {}
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(dtype)
    try:
        with strategy.scope():
            model = models.build(model_name, num_classes=num_classes, input_shape=image_shape,
                                 **kwargs)
            model.compile(optimizer=make_optimizer(),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], jit_compile=jit_compile,
                          steps_per_execution=steps_per_execution)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return model


def check_compile_options(jit_compile: bool, strategy: tf.distribute.Strategy,
                          device_set: devices_lib.DeviceSet) -> None:
    """Raises for compile options that the stack cannot run on this strategy and devices,
    before any work (the strategy would refuse them at the first step).

    Raises:
        ConfigError: For XLA on several replicas with CPUs among them
            (:func:`tfpar.strategies.refusals.check_xla`).
    """
    del device_set  # The strategy's own devices say it.
    refusals.check_xla(jit_compile, strategy)


def replica_devices(strategy: tf.distribute.Strategy,
                    device_set: devices_lib.DeviceSet) -> list[str]:
    """Names every replica's device, over all workers (``worker:1/CPU:0``) for multi-worker."""
    # Only a multi-worker strategy has other workers (and the default one no worker devices).
    num_workers = (strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)
                   if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) else 1)
    if num_workers == 1:
        return list(device_set.names)
    return [f"worker:{w}/{name}" for w in range(num_workers) for name in device_set.names]
