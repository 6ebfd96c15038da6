"""Training FLOPs per image from the layer shapes, for utilisation figures.

A multiply-add counts as 2 FLOPs. Convolutions and dense layers dominate; the forward pass of
a ``Conv2D`` costs ``2 * kh * kw * c_in * c_out * h_out * w_out`` (plus one add per output for
the bias) and of a ``Dense`` ``2 * n_in * n_out`` (plus ``n_out``). Training costs three forward
passes: the forward pass, and in the backward pass one for the gradients of the inputs and one
for those of the weights. Normalisation, activations and pooling are counted as one FLOP per
output element, which is small beside the convolutions.
"""

from __future__ import annotations

import math

import keras

# Forward, input-gradient and weight-gradient passes.
TRAINING_PASSES = 3


def _elements(shape) -> int:
    return math.prod(d for d in shape[1:] if d is not None)


def forward_flops_per_image(model: keras.Model) -> int:
    """Returns the forward-pass FLOPs for one image of a built functional/Sequential model."""
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        out = _elements(layer.output.shape)
        if isinstance(layer, keras.layers.Conv2D):
            kh, kw = layer.kernel_size
            c_in = layer.input.shape[-1]
            total += 2 * kh * kw * c_in * out + (out if layer.use_bias else 0)
        elif isinstance(layer, keras.layers.Dense):
            total += 2 * layer.input.shape[-1] * out + (out if layer.use_bias else 0)
        elif isinstance(layer, (keras.layers.Flatten, keras.layers.Reshape)):
            continue
        else:
            total += out
    return total


def training_flops_per_image(model: keras.Model) -> int:
    """Returns the FLOPs of one training step per image (forward and backward)."""
    return TRAINING_PASSES * forward_flops_per_image(model)
