"""The concise chapter's modified ResNet-18 for small images.

Compared with the ImageNet ResNet-18, the stem is a 3x3 convolution with stride 1 and there is
no max-pool. Four stages of two residual blocks (64, 128, 256, 512 channels) follow; the first
block of stages 2-4 halves the spatial size with stride 2 and projects the shortcut with a 1x1
convolution. Global average pooling and a dense layer give the logits. Convolutions keep their
bias, as in the chapter's ``Residual`` block.
"""

from __future__ import annotations

import functools

import keras
from keras import layers

from tfpar.models.arguments import check_builder_args

# PyTorch/Gluon BatchNorm defaults: faster-moving statistics than Keras's 0.99, which
# matters for short runs of a few epochs.
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5


def _residual_block(x, channels: int, strides: int, project: bool, name: str,
                    batch_norm) -> keras.KerasTensor:
    """The chapter's ``Residual``: conv-BN-ReLU-conv-BN plus (projected) shortcut, ReLU."""
    shortcut = x
    y = layers.Conv2D(channels, 3, strides=strides, padding="same", name=f"{name}_conv1")(x)
    y = batch_norm(name=f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = layers.Conv2D(channels, 3, padding="same", name=f"{name}_conv2")(y)
    y = batch_norm(name=f"{name}_bn2")(y)
    if project:
        shortcut = layers.Conv2D(channels, 1, strides=strides, name=f"{name}_shortcut")(x)
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    return layers.ReLU(name=f"{name}_out")(y)


def resnet(stage_channels: tuple[int, ...], blocks_per_stage: tuple[int, ...],
           num_classes: int = 10, input_shape: tuple[int, ...] = (28, 28, 1),
           synchronized_batchnorm: bool = False, name: str = "resnet") -> keras.Model:
    """Builds a small-image ResNet.

    Args:
        stage_channels: Channels of each stage; the stem has ``stage_channels[0]``.
        blocks_per_stage: Residual blocks in each stage.
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``, any size of at least 8x8.
        synchronized_batchnorm: Compute BatchNorm statistics over the global batch (all
            replicas) instead of each replica's shard.
        name: Model name, also the prefix of every layer name.

    Returns:
        A functional Keras model mapping images to logits.

    Raises:
        ValueError: If the arguments are invalid.
    """
    check_builder_args(num_classes, input_shape, min_size=8)
    if len(stage_channels) != len(blocks_per_stage) or not stage_channels:
        raise ValueError("stage_channels and blocks_per_stage must be non-empty and of equal "
                         f"length. Received: {stage_channels}, {blocks_per_stage}.")
    batch_norm = functools.partial(layers.BatchNormalization, momentum=_BN_MOMENTUM,
                                   epsilon=_BN_EPSILON, synchronized=synchronized_batchnorm)
    inputs = keras.Input(shape=input_shape, name=f"{name}_input")
    x = layers.Conv2D(stage_channels[0], 3, padding="same", name=f"{name}_stem_conv")(inputs)
    x = batch_norm(name=f"{name}_stem_bn")(x)
    x = layers.ReLU(name=f"{name}_stem_relu")(x)
    for stage, (channels, blocks) in enumerate(zip(stage_channels, blocks_per_stage), start=1):
        for block in range(1, blocks + 1):
            downsample = stage > 1 and block == 1
            x = _residual_block(x, channels, strides=2 if downsample else 1, project=downsample,
                                name=f"{name}_stage{stage}_block{block}", batch_norm=batch_norm)
    x = layers.GlobalAveragePooling2D(name=f"{name}_avg_pool")(x)
    outputs = layers.Dense(num_classes, name=f"{name}_logits")(x)
    return keras.Model(inputs, outputs, name=name)


def resnet18(num_classes: int = 10, input_shape: tuple[int, ...] = (28, 28, 1),
             synchronized_batchnorm: bool = False, name: str = "resnet18") -> keras.Model:
    """Builds the reference modified ResNet-18 (see the module docstring).

    Args:
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``, e.g. ``(28, 28, 1)`` or ``(32, 32, 3)``.
        synchronized_batchnorm: Synchronise BatchNorm statistics across replicas.
        name: Model name, also the prefix of every layer name.

    Returns:
        A functional Keras model mapping images to logits.
    """
    return resnet((64, 128, 256, 512), (2, 2, 2, 2), num_classes=num_classes,
                  input_shape=input_shape, synchronized_batchnorm=synchronized_batchnorm,
                  name=name)
