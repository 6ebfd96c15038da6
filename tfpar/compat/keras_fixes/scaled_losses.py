"""Fix: a model's own ``train_step``/``test_step`` logs the whole loss, not 1/N of it.

**A model's own step logs a fraction of the loss** (``scale_loss_for_distribution``,
``Loss.__call__``, ``Trainer.compute_loss``, ``Mean.update_state``). Inside a replica
context of N replicas, a Keras loss and ``compute_loss`` return the loss divided by N, so
that the replicas' gradients sum to the batch's. Keras's own steps multiply it back before
their loss tracker sees it; a model's own ``train_step``/``test_step`` written as keras.io's
"customizing what happens in fit" guide teaches (``loss = self.compute_loss(...)``, then
``metric.update_state(loss)`` for the metric named ``"loss"``) logged and evaluated 1/N of
the loss (0.817 against 1.635 on one device, 2 replicas). The fix marks the values Keras
scaled by 1/N (the output of a ``Loss`` call or of Keras's ``compute_loss`` during which
Keras scaled), and a ``Mean`` metric given such a value records it times N. Gradients are
untouched, and a value the user scaled back (``loss * N``) is a new, unmarked one.

Upstream: none found. Checked on Keras 3.15.1; the wrapped code is the same from 3.0 to 3.15.
Fails without it: ``tests/end_to_end/fit_interface_test.py``
(``test_half_the_loss_without_the_fix``).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfpar.compat.keras_fixes.fix import Fix
from tfpar.compat.keras_fixes.fix import model_base_defining


def _loss_module() -> Any:
    """Keras's loss module, whose ``scale_loss_for_distribution`` every Keras loss and the
    TensorFlow trainer call by module attribute (imported behind the gate)."""
    return importlib.import_module("keras.src.losses.loss")


def _trainer_base() -> Any:
    """Keras's backend-neutral trainer, which defines ``compute_loss`` (``Trainer`` to 3.15,
    ``BaseTrainer`` in 3.16)."""
    return model_base_defining("compute_loss", "keras.src.trainers")


# The replica counts Keras divided losses by while a Loss call or compute_loss ran (a stack of
# lists per thread: nested calls report to the outer one), and the values it returned.
_scales = threading.local()
# The factor mean-type losses are scaled by in place of 1/N, per thread (mean_losses_scaled_by).
_override = threading.local()
_marked: dict[int, tuple[weakref.ref, int]] = {}


def _mark(value: Any, replicas: int) -> None:
    key = id(value)

    def forget(_: weakref.ref) -> None:
        _marked.pop(key, None)

    _marked[key] = (weakref.ref(value, forget), replicas)


def replicas_scaled(value: Any) -> int:
    """N when ``value`` is a loss Keras divided by N replicas for the gradient, else 1."""
    entry = _marked.get(id(value))
    return entry[1] if entry is not None and entry[0]() is value else 1


@contextlib.contextmanager
def _recording_scales():
    outer = getattr(_scales, "current", None)
    inner: list[int] = []
    _scales.current = inner
    try:
        yield inner
    finally:
        _scales.current = outer
        if outer is not None:
            outer.extend(inner)


@contextlib.contextmanager
def mean_losses_scaled_by(factor: Any):
    """While active in this thread, Keras scales a loss it would divide by the replica count
    (a mean-type reduction, ``sum_over_batch_size``/``mean``, and the additional losses of
    ``add_loss`` and regularizers) by ``factor`` instead, on any number of replicas; a
    ``"sum"`` loss stays as Keras leaves it. The all-reduce step weighs each replica's mean
    losses by its share of the global batch this way, and keeps its sum losses whole.

    Needs the fix ``scaled_loss_records`` installed (``keras_fixes.install``).

    Args:
        factor: A scalar (a tensor in a traced step).
    """
    outer = getattr(_override, "factor", None)
    _override.factor = factor
    try:
        yield
    finally:
        _override.factor = outer


def _wrap_scale(original: Callable) -> Callable:
    @functools.wraps(original)
    def scale_loss_for_distribution(value):
        factor = getattr(_override, "factor", None)
        if factor is not None:
            return value * tf.cast(factor, value.dtype)
        scaled = original(value)
        current = getattr(_scales, "current", None)
        if scaled is not value and current is not None:
            current.append(tf.distribute.get_strategy().num_replicas_in_sync)
        return scaled

    return scale_loss_for_distribution


def _wrap_marking(original: Callable) -> Callable:
    """Marks what ``original`` (a Loss call, ``compute_loss``) returns when Keras scaled during
    it, by one replica count."""
    @functools.wraps(original)
    def marking(*args, **kwargs):
        with _recording_scales() as scales:
            result = original(*args, **kwargs)
        if scales and len(set(scales)) == 1 and tf.is_tensor(result):
            _mark(result, scales[0])
        return result

    return marking


def _wrap_mean_update(original: Callable) -> Callable:
    @functools.wraps(original)
    def update_state(self, values, sample_weight=None):
        replicas = replicas_scaled(values)
        if replicas > 1:
            values = values * tf.cast(replicas, values.dtype)
        return original(self, values, sample_weight=sample_weight)

    return update_state


FIXES = (
    Fix("scaled_loss_records", "the losses Keras divides by the replica count for the "
        "gradient are recorded (and weighed by a replica's share of the batch in the "
        "all-reduce step)", _loss_module, "scale_loss_for_distribution", _wrap_scale,
        parameters=("value",)),
    Fix("scaled_loss_marks", "a Keras loss's value divided by the replica count is marked so",
        lambda: keras.losses.Loss, "__call__", _wrap_marking,
        parameters=("self", "y_true", "y_pred", "sample_weight")),
    Fix("scaled_compute_loss_marks", "the same for Keras's compute_loss",
        _trainer_base, "compute_loss", _wrap_marking,
        parameters=("self", "x", "y", "y_pred", "sample_weight")),
    Fix("mean_of_scaled_losses", "a Mean metric given a marked loss records the whole loss "
        "(a model's own train_step/test_step logs what one device logs)",
        lambda: keras.metrics.Mean, "update_state", _wrap_mean_update,
        parameters=("self", "values", "sample_weight")),
)
