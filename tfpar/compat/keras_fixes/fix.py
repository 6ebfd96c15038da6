"""What a Keras fix is: the private attribute of Keras it wraps and how, and what the fixes
share (the gate's private imports, the test for several workers).

No public Keras API exposes the TensorFlow trainer, its symbolic build, its reduction of logs,
how its variables add, or the internals of ``BackupAndRestore`` and the epoch iterator, so each
fix wraps one private attribute of Keras and keeps the original, which it calls wherever its
defect is not. The private modules are imported only through the functions here, and only
once the version gate (:func:`tfpar.compat.keras_fixes.skip_reason`) allows it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix: which attribute of which object it wraps, and how.

    Attributes:
        name: Short name (``tfpar-env`` shows it).
        description: What it fixes, in one line.
        owner: Returns the object whose attribute is wrapped.
        attribute: The attribute.
        wrap: Returns the wrapper of the original.
    """

    name: str
    description: str
    owner: Callable[[], Any]
    attribute: str
    wrap: Callable[[Callable], Callable]


def tf_trainer() -> Any:
    """Keras's TensorFlow trainer module (``keras.src.backend.tensorflow.trainer``)."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def several_workers(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` spans several worker processes."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.num_replicas_in_sync != len(strategy.extended.worker_devices))
