"""The environment of the worker processes tfpar starts (the launcher's, the benchmark's).

They inherit the parent's environment except ``TF_USE_LEGACY_KERAS``: Ray Train's
``TensorflowTrainer`` (Ray 2.60, ``ray/train/tensorflow/config.py``) sets it to ``1`` in every
Ray worker, because Keras 3 lacked multi-worker support there. In the Ray worker itself it
changes nothing (TensorFlow is already imported, ``tf.keras`` stays Keras 3), but a process the
worker starts would get Keras 2 (the ``tf_keras`` package, when installed) for ``tf.keras``,
and a model built with it cannot train under tfpar's strategies, which are Keras 3's. tfpar's
workers therefore run with Keras 3, wherever they are started from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
"""TensorFlow's switch of ``tf.keras`` to Keras 2 (``tf_keras``)."""


def legacy_keras_asked(environment: Mapping[str, str] | None = None) -> bool:
    """Whether ``environment`` (this process's by default) switches ``tf.keras`` to Keras 2: as
    TensorFlow 2.21 reads it (``tensorflow/__init__.py``), for ``1``, ``true`` and ``True``."""
    value = (os.environ if environment is None else environment).get(LEGACY_KERAS_ENV)
    return value in ("1", "true", "True")


def worker_environment(values: Mapping[str, str] | None = None,
                       environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a tfpar worker process starts with.

    Args:
        values: Variables to set in it (``TF_CONFIG``, ...).
        environment: The parent's (this process's by default).

    Returns:
        ``environment`` with ``values`` and without ``TF_USE_LEGACY_KERAS``.
    """
    base = dict(os.environ if environment is None else environment)
    base.pop(LEGACY_KERAS_ENV, None)
    return {**base, **(values or {})}
