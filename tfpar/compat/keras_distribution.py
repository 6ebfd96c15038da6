"""Where tfpar hooks into Keras's distribution API on the TensorFlow backend.

Keras 3 has one backend-neutral way to say "data parallel", ``keras.distribution``. Its
TensorFlow backend is a stub (``keras/src/backend/tensorflow/distribution_lib.py`` begins "DO
NOT USE"; upstream: keras-team/keras#18983): ``list_devices`` works, ``initialize``,
``num_processes``, ``process_id``, ``distribute_tensor``, ``distribute_variable`` and
``distribute_data_input`` are missing, and ``set_distribution`` changes nothing the TensorFlow
trainer reads (a model trains under the ``tf.distribute`` strategy it was built under). No
public API lets a library act when a distribution is set or fill in a backend's functions, so
this module, behind the Keras version gate (:func:`tfpar.compat.versions.keras_skip_reason`):

- wraps ``set_distribution`` where Keras keeps it (``keras.src.distribution.distribution_lib``,
  which ``Distribution.scope`` calls) and where users call it (``keras.distribution``): the
  given callback runs first, and may refuse the distribution (an exception: nothing is set);
- sets the given functions on the TensorFlow backend's module: those it lacks, and
  ``list_devices`` where a job's devices span several processes (restored by
  :func:`uninstall`);
- wraps the TensorFlow backend's ``Variable._initialize``, which makes every Keras variable's
  ``tf.Variable`` and ignores the variable's own ``layout`` (``keras.Variable(layout=...)``),
  so that the backend's ``distribute_variable`` given here sees each variable's layout (and may
  refuse a sharded one) as Keras's JAX backend has it do.

What the callback and the functions do is :mod:`tfpar.keras_distribution`'s. Checked on Keras
3.15.1 (the stub is the same from 3.0 to 3.15) and the preview 3.16.0.dev2026102704. Fails
without it: ``tests/keras_distribution_test.py``
(``test_without_tfpar_keras_trains_on_one_device``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import keras

from tfpar.compat import versions
from tfpar.compat.keras_fixes.fix import tf_variable_class

_KERAS = "keras.src.distribution.distribution_lib"
_PUBLIC = "keras.distribution"
_BACKEND = "keras.src.backend.tensorflow.distribution_lib"
_SET = "set_distribution"
_INITIALIZE = "_initialize"
_original_initialize: Callable[..., Any] | None = None
_original_set: Callable[[Any], None] | None = None
_replaced: dict[str, Any] = {}  # The backend's own function, or None where it had none.


def skip_reason() -> str | None:
    """Why the hook cannot be installed here (``None``: it can)."""
    if keras.backend.backend() != "tensorflow":
        return f"Keras runs the {keras.backend.backend()} backend, not TensorFlow"
    reason = versions.keras_skip_reason(keras.version())
    if reason:
        return reason
    try:
        module = importlib.import_module(_KERAS)
        importlib.import_module(_BACKEND)
        tf_variable_class()
    except (ImportError, LookupError) as e:
        return f"Keras's distribution modules are not where they were read ({e})"
    if not callable(getattr(module, "set_distribution", None)):
        return f"{_KERAS} has no set_distribution"
    return None


def install(on_set: Callable[[Any], None], backend: Mapping[str, Callable[..., Any]]) -> None:
    """Runs ``on_set(distribution)`` before Keras sets a distribution, and sets the functions
    in ``backend`` on the TensorFlow backend's module; idempotent (a second call replaces the
    callback and the functions).

    Raises:
        RuntimeError: Where :func:`skip_reason` says it cannot (its reason).
    """
    global _original_set
    reason = skip_reason()
    if reason:
        raise RuntimeError(reason)
    module, public = importlib.import_module(_KERAS), importlib.import_module(_PUBLIC)
    if _original_set is None:
        _original_set = getattr(module, _SET)
    original = _original_set

    @functools.wraps(original)
    def set_distribution(value):
        on_set(value)
        original(value)

    set_distribution._tfpar_hook = True  # type: ignore[attr-defined]
    for owner in (module, public):
        setattr(owner, _SET, set_distribution)
    backend_module = importlib.import_module(_BACKEND)
    for name, function in backend.items():
        if name not in _replaced:
            _replaced[name] = getattr(backend_module, name, None)
        setattr(backend_module, name, function)
    _install_variable_layouts(backend_module)


def _install_variable_layouts(backend_module: Any) -> None:
    """Makes each Keras variable made on the TensorFlow backend pass its own layout to the
    backend's ``distribute_variable`` first."""
    global _original_initialize
    variable_class = tf_variable_class()
    if _original_initialize is None:
        _original_initialize = variable_class.__dict__[_INITIALIZE]
    original = _original_initialize

    @functools.wraps(original)
    def initialize(self, value):
        layout = getattr(self, "_layout", None)
        if layout is not None:
            backend_module.distribute_variable(value, layout)
        original(self, value)

    setattr(variable_class, _INITIALIZE, initialize)


def backend_function(name: str) -> Callable[..., Any] | None:
    """The TensorFlow backend's own ``name`` (``None`` where it has none), installed or not."""
    if name in _replaced:
        return _replaced[name]
    return getattr(importlib.import_module(_BACKEND), name, None)


def uninstall() -> None:
    """Restores Keras's own ``set_distribution`` and its backend's module: for tests that
    show what Keras does alone."""
    global _original_set
    if _original_set is not None:
        for owner in (_KERAS, _PUBLIC):
            setattr(importlib.import_module(owner), _SET, _original_set)
        _original_set = None
    global _original_initialize
    if _original_initialize is not None:
        setattr(tf_variable_class(), _INITIALIZE, _original_initialize)
        _original_initialize = None
    backend_module = importlib.import_module(_BACKEND)
    for name, original in _replaced.items():
        if original is None:
            delattr(backend_module, name)
        else:
            setattr(backend_module, name, original)
    _replaced.clear()


def installed() -> bool:
    """Whether the hook is installed."""
    return _original_set is not None
