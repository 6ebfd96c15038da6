"""Starting Keras's ``fit`` inside an epoch: the first epoch of a resumed run begins at a step.

Keras 3's ``fit`` takes ``initial_epoch`` but no step: a state saved in the middle of an epoch
(after a preemption notice, or by ``BackupAndRestore(save_freq=N)``) would have the resumed run
train that epoch's first steps again, on weights that already learned from them. No public
Keras API starts an epoch at a step, so this wraps the method that numbers an epoch's steps
(``keras.src.trainers.epoch_iterator.EpochIterator._enumerate_iterator``, unchanged from Keras
3.0 to 3.15): when :func:`start_next_epoch_at` armed it (a callback's ``on_epoch_begin``, which
``fit`` calls just before it iterates the epoch), the epoch's first ``step`` batches are drawn
from the input and dropped, never reaching the model, and numbering continues from ``step``, so
callbacks see the batch indices an uninterrupted run has. Everything else is Keras's own code.
It is installed with tfpar's other Keras fixes (:mod:`tfpar.compat.keras_fixes`, the same
version gate); ``tests/compat/keras_fixes_test.py`` shows a resumed epoch running its first
steps again without it.

:func:`metric_values` and :func:`assign_metric_values` carry the partial epoch's metrics (the
running loss and accuracy) across the restart: ``fit`` resets them when the epoch begins, and
they are set again right after.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar.compat import versions
from tfpar.errors import ConfigError

_pending = threading.local()  # .step: where the next epoch iterated in this thread begins.


def skip_reason() -> str | None:
    """Why ``fit`` cannot start a resumed epoch at a step on this Keras (``None``: it can; the
    wrapper is installed with the Keras fixes, behind the same gate)."""
    return versions.keras_skip_reason(keras.version())


def start_next_epoch_at(step: int) -> None:
    """Makes the next epoch that ``fit`` iterates in this thread start at batch ``step``.

    Call it from a callback's ``on_epoch_begin``; the input's first ``step`` batches of that
    epoch are drawn and dropped. Steps are counted in batches (a multiple of the model's
    ``steps_per_execution``).
    """
    _pending.step = int(step)


def wrap_enumerate_iterator(original: Callable) -> Callable:
    """The wrapper of ``EpochIterator._enumerate_iterator`` (see the module docstring)."""

    @functools.wraps(original)
    def _enumerate_iterator(self):
        skip, _pending.step = getattr(_pending, "step", 0), 0
        for begin, end, iterator in original(self):
            if begin < skip:  # Already trained before the restart: drawn, not trained on.
                for _ in range(end - begin + 1):
                    try:
                        next(iterator)
                    except (StopIteration, tf.errors.OutOfRangeError):
                        raise ConfigError(
                            f"The saved state resumes this epoch at step {skip}, but the data "
                            f"has fewer batches in it. Resume with the data and batch "
                            "size the state was saved with, or start over (resume=False)."
                        ) from None
                continue
            yield begin, end, iterator

    return _enumerate_iterator


def metric_values(model: keras.Model) -> list[np.ndarray]:
    """The values of ``model``'s metric variables (aggregated over replicas), in order."""
    return [np.array(keras.ops.convert_to_numpy(v))
            for v in getattr(model, "metrics_variables", ())]


def assign_metric_values(model: keras.Model, values: Sequence[np.ndarray]) -> bool:
    """Sets ``model``'s metric variables to ``values`` (from :func:`metric_values`).

    Returns:
        Whether they were set: ``False`` (and a warning) when the model's metric variables do
        not match them, e.g. not built yet in a model compiled outside a strategy's scope,
        whose metrics Keras builds in the first step; the epoch's logs then cover the steps
        after the restart only.
    """
    variables = model.metrics_variables
    if len(variables) != len(values) or any(
            tuple(v.shape) != np.shape(value) for v, value in zip(variables, values)):
        logging.warning("The metrics of the interrupted epoch were not restored (the model's %d "
                        "metric variables do not match the %d saved); its loss and metrics "
                        "cover the steps after the restart.", len(variables), len(values))
        return False
    for variable, value in zip(variables, values):
        variable.assign(np.asarray(value, dtype=variable.dtype))
    return True
