"""The Keras optimizer and model state that tfpar's exact all-reduce step reads and updates.

The step (:mod:`tfpar.allreduce.step`) applies the all-reduced gradient itself, on every
replica's copy of every variable, because Keras 3's TensorFlow optimizer all-reduces the
gradients again whenever ``Optimizer.apply`` runs in a replica context. Doing what ``apply``
does around the public ``update_step`` (the iteration counter, gradient accumulation, weight
decay with its exclusions, the EMA averages) and updating the loss ``fit`` logs needs state
that Keras keeps in private attributes; no public API exposes it:

- ``optimizer._iterations``: the counter ``apply`` increments every call. The public
  ``iterations`` is that variable only without ``gradient_accumulation_steps``; with it, it
  is ``_iterations // steps``, a tensor.
- ``optimizer._accumulated_gradients`` and ``_get_variable_index``: the accumulators.
- ``optimizer._trainable_variables`` and ``_model_variables_moving_average``: the EMA pairs.
- ``optimizer._use_weight_decay(variable)``: ``exclude_from_weight_decay``'s rule.
- ``model._loss_tracker``: the running mean ``fit`` logs as ``loss`` (Keras's own
  ``train_step`` updates it; ``fit`` reads and resets it).

These are read through this module only, on the Keras versions of
:data:`tfpar.compat.versions.VERIFIED_KERAS` (Keras 3.0-3.15: the attributes and their
meaning are unchanged there); elsewhere each accessor raises one line naming the feature. The
tests of weight decay, EMA, accumulation and the logged loss under ``allreduce``
(``tests/allreduce/step_test.py``) fail without them.
"""

from __future__ import annotations

from typing import Any

import keras

from tfpar.compat import versions
from tfpar.errors import ConfigError


def skip_reason() -> str | None:
    """Why the Keras state below cannot be read on this Keras (``None``: it can)."""
    return versions.keras_skip_reason(keras.version())


def _internal(owner: Any, attribute: str, feature: str) -> Any:
    reason = skip_reason()
    if reason is None and hasattr(owner, attribute):
        return getattr(owner, attribute)
    why = reason or f"Keras {keras.version()} has no {type(owner).__name__}.{attribute}"
    raise ConfigError(f"tfpar's all-reduce step cannot apply {feature} on this Keras: {why}. "
                      f"It reads Keras state verified on Keras {versions.keras_range_text()}; "
                      "train with 'mirrored' instead, or install a verified Keras.")


def iterations_variable(optimizer: keras.optimizers.Optimizer) -> keras.Variable:
    """The variable ``optimizer.apply`` increments once per call (every batch, also while
    accumulating gradients)."""
    return _internal(optimizer, "_iterations", "the optimizer's iteration count")


def gradient_accumulators(optimizer: keras.optimizers.Optimizer,
                          variables: list) -> list[keras.Variable]:
    """The accumulator of each of ``variables`` (``gradient_accumulation_steps``)."""
    accumulators = _internal(optimizer, "_accumulated_gradients", "gradient_accumulation_steps")
    index = _internal(optimizer, "_get_variable_index", "gradient_accumulation_steps")
    return [accumulators[index(v)] for v in variables]


def moving_averages(optimizer: keras.optimizers.Optimizer) -> list[tuple[Any, Any]]:
    """``(variable, average)`` for every variable the optimizer keeps an EMA of (``use_ema``)."""
    variables = _internal(optimizer, "_trainable_variables", "use_ema")
    averages = _internal(optimizer, "_model_variables_moving_average", "use_ema")
    return [(v, a) for v, a in zip(variables, averages) if a is not None]


def uses_weight_decay(optimizer: keras.optimizers.Optimizer, variable: Any) -> bool:
    """Whether ``optimizer`` decays ``variable`` (``exclude_from_weight_decay`` honoured)."""
    return bool(_internal(optimizer, "_use_weight_decay", "weight_decay")(variable))


def loss_tracker(model: keras.Model) -> keras.metrics.Metric:
    """The metric ``fit`` logs as ``loss`` (a running mean over the epoch's steps)."""
    return _internal(model, "_loss_tracker", "the logged loss")
