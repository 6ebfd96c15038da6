"""A checkpoint's state copied to host memory at a step, and written in the background.

A save that blocks the step for its whole write costs its write time at every save; CheckFreq
(FAST'21) splits it into a *snapshot*, a copy of the state in memory that the step waits for,
and a *persist*, the write, which overlaps the training that follows. TensorFlow's own
asynchronous checkpoint (``tf.train.CheckpointOptions(enable_async=True)``) fails on Keras 3
variables: it copies each object to the CPU through its ``_copy_trackable_to_cpu``, which
Keras's variable implements with a ``tf.function`` that creates variables on every call
(``ValueError: tf.function only supports singleton tf.Variables created on the first call``).

So, with public APIs only: :class:`HostMirror` builds, once, a mirror of a
``tf.train.Checkpoint``'s object graph (``tf.train.TrackableView``), the same children under
the same names in the same order, whose variables are plain ``tf.Variable``\\ s in host memory.
:meth:`HostMirror.take` copies every variable's value into its mirror (on a GPU, a copy to
host memory; on the CPU, a copy in memory), and the mirror is what is written: a checkpoint
with the same keys and values as the original's, which the original restores. A variable's
value is read as TensorFlow's checkpoint reads it (a mirrored variable's, a sync-on-read
variable's aggregate). :class:`BackgroundWriter` runs the writes on one thread, at most one in
flight: a new one waits for the last, and :meth:`BackgroundWriter.wait` raises what a write
raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["BackgroundWriter", "HostMirror", "NotMirrored"]


class NotMirrored(Exception):
    """The checkpoint holds an object whose state the mirror cannot copy (not a variable)."""


class _Captured(tf.train.experimental.PythonState):
    """A Python state's serialized value, as it was at the snapshot."""

    def __init__(self, original: tf.train.experimental.PythonState):
        self.original, self.value = original, original.serialize()

    def serialize(self) -> str:
        return self.value

    def deserialize(self, string_value: Any) -> None:
        self.value = string_value


class HostMirror:
    """A mirror in host memory of the checkpoint ``root`` (see the module docstring).

    Args:
        root: The checkpoint whose state is mirrored.

    Raises:
        NotMirrored: If ``root`` holds state other than variables, Python states, and the
            objects and lists that hold them.
    """

    def __init__(self, root: tf.train.Checkpoint):
        self._pairs: list[tuple[tf.Variable, Any]] = []
        self._states: list[_Captured] = []
        self._memo: dict[int, Any] = {}
        children = tf.train.TrackableView(root).children(root)
        self.checkpoint = tf.train.Checkpoint(**{name: self._mirror(child)
                                                 for name, child in children.items()})

    def _mirror(self, obj: Any) -> Any:
        if id(obj) in self._memo:  # An object reachable by two paths is one object.
            return self._memo[id(obj)]
        mirrored: Any
        if isinstance(obj, (tf.Variable, keras.Variable)):
            value = obj.value if isinstance(obj, keras.Variable) else obj
            with tf.device("/cpu:0"):
                mirrored = tf.Variable(tf.zeros(value.shape, value.dtype), trainable=False,
                                       name=value.name.split(":")[0].rsplit("/", 1)[-1])
            self._pairs.append((mirrored, value))
        elif isinstance(obj, tf.train.experimental.PythonState):
            mirrored = _Captured(obj)
            self._states.append(mirrored)
        else:
            children = tf.train.TrackableView(obj).children(obj)
            if not children and not isinstance(obj, (list, dict, tf.Module,
                                                     keras.optimizers.Optimizer)):
                raise NotMirrored(f"{type(obj).__name__} holds state that is not a variable")
            mirrored = tf.Module()
            self._memo[id(obj)] = mirrored
            for name, child in children.items():  # In the original's order, which names keys.
                setattr(mirrored, name, self._mirror(child))
        self._memo[id(obj)] = mirrored
        return mirrored

    @property
    def nbytes(self) -> int:
        """The bytes of state the mirror holds."""
        return sum(int(m.shape.num_elements() or 0) * m.dtype.size for m, _ in self._pairs)

    def take(self) -> None:
        """Copies the state into the mirror (the snapshot a write then reads)."""
        if self._pairs:
            self._copy()
        for state in self._states:
            state.value = state.original.serialize()

    @tf.function
    def _copy(self) -> None:
        # One call for every variable (one eager op each took 45 ms for ResNet-18's 264, one
        # call 2 ms). On the CPU TensorFlow shares an unchanged buffer and copies it when the
        # variable is next updated (copy on write): the copy is the next step's, as large.
        for mirrored, variable in self._pairs:
            mirrored.assign(variable.read_value())


class BackgroundWriter:
    """Runs writes on a background thread, one at a time.

    A write's exception is kept and raised by the next :meth:`wait` (which :meth:`start` calls
    first). The thread is not a daemon: a process that ends normally finishes its write first.
    """

    def __init__(self, name: str = "tfpar-checkpoint-writer"):
        self._name = name
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a write is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None]) -> None:
        """Waits for the write in flight (raising what it raised), then starts ``write``."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - raised again by wait().
                self._failure = e

        self._thread = threading.Thread(target=run, name=self._name, daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Waits for the write in flight; raises what it raised (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
