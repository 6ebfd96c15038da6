"""Collective instance keys fixed when a function is traced, for loops around a step.

Each collective of ``MultiWorkerMirroredStrategy`` carries an *instance key* that pairs it with
the same collective on the other workers. TensorFlow (read in 2.21, measured there) feeds that
key when a function is *called* (``CollectiveReplicaLauncher._next_instance_key`` defers it with
``capture_call_time_value``), and the deferred value is not carried out of a ``tf.cond`` or
``tf.while_loop`` around a call of another ``tf.function``. Keras's loop for several steps per
compiled call (``compile(steps_per_execution=k)``) is exactly that: its one-step
``tf.function`` runs in a ``tf.cond`` inside a ``tf.while_loop``; across workers the first call
fails with ``You must feed a value for placeholder tensor '.../while/cond/Placeholder'``
(keras-team/keras#19246).

:func:`assigned_when_traced` makes the collectives built inside it take their keys when they are
traced, the way TensorFlow assigned them before call-time keys (its own switch,
``CollectiveReplicaLauncher._prefer_unique_instance_key``, which no public API exposes). The
keys come from the same per-group counter, so they stay paired across workers as long as the
workers trace the same functions in the same order, which ``fit`` does. Used only on the
TensorFlow versions of :data:`VERIFIED_TENSORFLOW` and imported behind that gate
(:func:`skip_reason`); ``tests/compat/keras_fixes_test.py`` runs the multi-step loop across two
workers without it and shows the failure.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from tfpar.compat import class_patch
from tfpar.compat import versions

VERIFIED_TENSORFLOW = versions.VERIFIED_TENSORFLOW
_MODULE = "tensorflow.python.distribute.cross_device_utils"
_SWITCH = "_prefer_unique_instance_key"


def _launcher_class() -> Any:
    return importlib.import_module(_MODULE).CollectiveReplicaLauncher


def skip_reason() -> str | None:
    """Why keys cannot be assigned when traced on this TensorFlow (``None``: they can)."""
    return versions.tensorflow_member_skip_reason(_MODULE, "CollectiveReplicaLauncher", _SWITCH)


@contextlib.contextmanager
def assigned_when_traced() -> Iterator[None]:
    """Collectives traced inside take their instance keys at tracing, not at each call.

    Calls of functions traced before are unaffected. Only where :func:`skip_reason` is
    ``None``; the caller checks.
    """
    with class_patch.attribute_set(_launcher_class(), _SWITCH, False):
        yield
