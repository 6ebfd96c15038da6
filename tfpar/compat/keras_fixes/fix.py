"""What a Keras fix is: the private attribute of Keras it wraps and how, how it finds it, and
what the fixes share (the lookups by what a target must have, the test for several workers).

No public Keras API exposes the TensorFlow trainer, its symbolic build, its reduction of logs,
how its variables add, or the internals of ``BackupAndRestore`` and the epoch iterator, so each
fix wraps one private attribute of Keras and keeps the original, which it calls wherever its
defect is not. A fix finds its target by what the target must have, not by the name it had in
the release it was read against: the class that runs ``fit``'s step under the TensorFlow
backend is the one of ``keras.Model``'s bases, from that backend, that defines the method
(``TensorFlowTrainer`` to Keras 3.15, ``Trainer`` in 3.16), and the method's parameters are
those the wrapper passes on. When a target is missing or changed, the fix is not installed and
says so in one line (:class:`FixUnavailable`); the private modules are imported only here, and
only once the version gate (:func:`tfpar.compat.keras_fixes.skip_reason`) allows it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

TF_BACKEND = "keras.src.backend.tensorflow"
"""The package of Keras's TensorFlow backend: where the classes the fixes wrap come from."""


class FixUnavailable(Exception):
    """A fix's target is missing or not what the fix was written for (its message says which,
    in words for one line)."""


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix: which attribute of which object it wraps, and how.

    Attributes:
        name: Short name (``tfpar-env`` shows it).
        description: What it fixes, in one line.
        owner: Returns the object whose attribute is wrapped, found by what it must have
            (raises ``LookupError``, ``ImportError`` or ``AttributeError`` when it is not
            there).
        attribute: The attribute.
        wrap: Returns the wrapper of the original.
        parameters: The leading parameters of the original that the wrapper relies on, by
            name (none: not checked).
        upstream: The upstream issue of the defect (or "none found").
        read_against: The Keras releases the fix's target was read in.
    """

    name: str
    description: str
    owner: Callable[[], Any]
    attribute: str
    wrap: Callable[[Callable], Callable]
    parameters: tuple[str, ...] = ()
    upstream: str = "none found"
    read_against: str = "3.0 to 3.15 and 3.16.0.dev2026102704"

    def target(self) -> tuple[Any, Callable]:
        """The owner and the original it wraps.

        Raises:
            FixUnavailable: If the target is missing, or its parameters are not those the
                wrapper passes on.
        """
        try:
            owner = self.owner()
        except (LookupError, ImportError, AttributeError) as e:
            raise FixUnavailable(f"its target is missing ({e})") from None
        where = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
        original = getattr(owner, self.attribute, None)
        if original is None:
            raise FixUnavailable(f"{where} has no {self.attribute}")
        if self.parameters:
            try:
                names = tuple(inspect.signature(original).parameters)
            except (TypeError, ValueError):
                names = ()
            if names[:len(self.parameters)] != self.parameters:
                raise FixUnavailable(
                    f"{where}.{self.attribute} takes ({', '.join(names)}), not "
                    f"({', '.join(self.parameters)}, ...) as when it was read")
        return owner, original

    def unavailable(self) -> str | None:
        """Why the fix cannot be installed on this Keras (``None``: it can)."""
        try:
            self.target()
        except FixUnavailable as e:
            return str(e)
        return None


def model_base_defining(attribute: str, package: str = TF_BACKEND) -> type:
    """The class among ``keras.Model``'s bases, from ``package``, that defines ``attribute``
    (e.g. the TensorFlow backend's trainer, whatever its name).

    Raises:
        LookupError: If none does.
    """
    for cls in keras.Model.__mro__:
        if attribute in vars(cls) and cls.__module__.startswith(package):
            return cls
    raise LookupError(f"no base class of keras.Model from {package} defines {attribute}")


def tf_variable_class() -> type:
    """The TensorFlow backend's class among ``keras.Variable``'s bases, whatever its module
    (``keras.src.backend.tensorflow.core`` to 3.15, ``.ops.core`` in 3.16): the TensorFlow
    tensor type whose ``_initialize`` makes the variable's ``tf.Variable``.

    Raises:
        LookupError: If none is.
    """
    for cls in keras.Variable.__mro__:
        if "_initialize" in vars(cls) and issubclass(cls, tf.__internal__.types.Tensor):
            return cls
    raise LookupError("no base class of keras.Variable is a TensorFlow tensor type that "
                      "creates the variable")


def tf_trainer_class() -> type:
    """The class that runs ``fit``'s step under the TensorFlow backend."""
    return model_base_defining("make_train_function")


def tf_trainer() -> Any:
    """The module of :func:`tf_trainer_class` (which holds ``reduce_per_replica``)."""
    return importlib.import_module(tf_trainer_class().__module__)


def several_workers(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` spans several worker processes."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.num_replicas_in_sync != len(strategy.extended.worker_devices))
