"""Values the workers of a job share through TensorFlow's coordination service.

A multi-worker job's workers agree on the step at which to stop after a preemption notice
(:mod:`tfpar.cluster.preemption`) by writing and waiting for keys in the coordination service's
key-value store, as TensorFlow's own ``tf.distribute.experimental.PreemptionCheckpointHandler``
does (``failure_handling.py``, TensorFlow 2.16-2.21). That handler is public but serves custom
training loops only (it restores on construction, counts its own ``run`` calls and exits the
process itself); the store it uses has no public API. ``tensorflow.python.eager.context``'s
``set_config_key_value`` (fails with ``AlreadyExistsError`` when the key exists) and
``get_config_key_value`` (blocks, releasing Python's interpreter, until the key exists or
the timeout passes) are imported here only, behind :data:`VERIFIED_TENSORFLOW`; elsewhere
:func:`skip_reason` says why, and a job's workers stop on their own notices only.
``tests/end_to_end/preempted_jobs_test.py`` signals one worker of a job and checks that every
worker stops at the same step (without the store, the other would wait in the next step's
collective).
"""

from __future__ import annotations

import importlib
from typing import Any

from tfpar.compat import versions

VERIFIED_TENSORFLOW = versions.VERIFIED_TENSORFLOW


def skip_reason() -> str | None:
    """Why this TensorFlow's key-value store is not used (``None``: it is)."""
    import tensorflow as tf

    return versions.tensorflow_skip_reason(tf.__version__)


def _context() -> Any:
    return importlib.import_module("tensorflow.python.eager.context").context()


def insert(key: str, value: str) -> bool:
    """Sets ``key`` to ``value`` for the whole job, unless some worker set it first.

    Returns:
        Whether this call set it (``False``: the key existed).
    """
    import tensorflow as tf

    try:
        _context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def wait_for(key: str, timeout_seconds: float | None = None) -> str | None:
    """The value of ``key`` once some worker has set it.

    Args:
        key: The key.
        timeout_seconds: How long to wait; ``None``: until it is set or the job ends.

    Returns:
        The value, or ``None`` if the wait timed out or the service went away.
    """
    import tensorflow as tf

    timeout_ms = 0 if timeout_seconds is None else max(1, int(timeout_seconds * 1000))
    try:
        return _context().get_config_key_value(key, timeout_ms)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError, tf.errors.InternalError):
        return None
