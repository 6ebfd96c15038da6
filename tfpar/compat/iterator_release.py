"""Frees the input iterators of tfpar's strategies on a background thread.

When an iterator over an autotuned ``tf.data`` pipeline is freed, TensorFlow (2.21, measured)
waits in the iterator's destructor for the pipeline's autotuning thread to finish, and that
thread only looks again at its next wake-up: it sleeps on a period that doubles from 10 ms to
several seconds (``RootDataset::Iterator::~Iterator`` ->
``LogicalThreadWrapper::~LogicalThreadWrapper``, seen with ``py-spy dump --native``). Keras
frees its iterator at the end of every ``fit``, ``evaluate`` and ``predict`` call and, on a
finite dataset, at the end of every epoch, so the call or the epoch ends up to seconds late,
with nothing running. Under ``tf.distribute`` every device has a pipeline of its own
(``MultiDeviceIterator``), so it happens more often and lasts longer: 9 of 10 ``fit`` calls of
60 LeNet steps under ``mirrored`` waited, up to 8 s, after ~2.5 s of training (README).

The strategy classes tfpar builds inherit
:class:`tfpar.strategies.base.TfparStrategy`: each iterator
of their distributed datasets, once dropped, is freed on a background thread of its own.
TensorFlow releases the GIL while the destructor waits, so training goes on meanwhile. The
input path itself is TensorFlow's, unchanged (same batches, same prefetching to devices).
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any

import tensorflow as tf

from tfpar.compat import versions

# The TensorFlow versions it applies to (those tfpar supports, whose tf.distribute datasets are
# plain Python classes; measured on 2.21): the range every TensorFlow workaround shares. Others
# keep TensorFlow's behaviour.
VERIFIED_TENSORFLOW = versions.VERIFIED_TENSORFLOW

MODE_ENV = "TFPAR_ITERATOR_RELEASE"  # "off": TensorFlow's behaviour (free where dropped).

# A background thread frees an iterator's state this long after the iterator died: the thread
# that dropped it clears the iterator's own references right after the finalizer returns.
_GRACE_SECONDS = 0.1
# At exit, how long to wait for iterators still being freed (each waits at most one
# autotuning period of its pipeline).
_EXIT_TIMEOUT_SECONDS = 60.0


def _tensorflow_version() -> str:
    return tf.__version__


def skip_reason() -> str | None:
    """Why iterators are not freed in the background here (``None``: they are)."""
    if os.environ.get(MODE_ENV, "") == "off":
        return f"{MODE_ENV}=off"
    return versions.tensorflow_skip_reason(_tensorflow_version())


class _Releaser:
    """Frees what it is given on background threads: one per iterator, so that no iterator's
    wait delays another's (an autotuning thread not joined at its wake-up sleeps again, for
    twice as long)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        # Reentrant: a garbage collection inside put() may drop another iterator.
        self._lock = threading.RLock()
        self._stopped = False
        self.released = 0  # How many states have been freed (for tests).

    def put(self, state: dict[str, Any]) -> None:
        """Frees ``state`` (an object's attributes) on a background thread."""
        if self._stopped or sys.is_finalizing():
            return  # Exiting: freed where it was dropped, as TensorFlow does.
        with self._lock:
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                    name="tfpar-iterator-release")
                self._dispatcher.start()
                atexit.register(self._stop)
        self._queue.put(state)

    def _dispatch(self) -> None:
        while True:
            state = self._queue.get()
            if state is None:
                return
            worker = threading.Thread(target=self._free, args=([state],), daemon=True,
                                      name="tfpar-iterator-release-worker")
            del state
            worker.start()
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]

    def _free(self, box: list[dict[str, Any]]) -> None:
        time.sleep(_GRACE_SECONDS)
        box.clear()  # The destructors run here, and wait here.
        with self._lock:
            self.released += 1

    def _stop(self) -> None:
        # Frees what is left before the interpreter goes, rather than during its teardown;
        # stopped meanwhile (Ctrl-C, a launcher stopping the job), it leaves quietly.
        self._stopped = True
        deadline = time.monotonic() + _EXIT_TIMEOUT_SECONDS
        try:
            self._queue.put(None)  # (A queue's put takes a lock: a signal may land in it.)
            if self._dispatcher is not None:
                self._dispatcher.join(_EXIT_TIMEOUT_SECONDS)
            for worker in list(self._workers):
                worker.join(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            pass


_releaser = _Releaser()


def status() -> dict[str, str]:
    """What ``tfpar-env`` reports: whether input iterators are freed in the background here."""
    reason = skip_reason()
    return {"applied": f"no: {reason}" if reason else "yes, by the strategies tfpar builds",
            "what": "tf.data iterators freed off the training thread, so fit calls and "
                    "epochs do not wait for the input pipeline's autotuning thread"}


def released_count() -> int:
    """How many iterators have been freed in the background in this process."""
    return _releaser.released


def release_in_background(iterator: Any) -> Any:
    """Arranges for ``iterator``'s state to be freed on a background thread when it is dropped.

    Args:
        iterator: An eager iterator (a Python object with attributes).

    Returns:
        ``iterator`` itself.
    """
    # Copies of its attributes keep what it holds alive past its own end; the finalizer runs
    # on whatever thread drops the iterator and only queues them.
    finalizer = weakref.finalize(iterator, _releaser.put, dict(vars(iterator)))
    finalizer.atexit = False
    return iterator


@functools.cache
def _releasing_class(cls: Any) -> type:
    def __iter__(self):
        iterator = cls.__iter__(self)
        return release_in_background(iterator) if tf.executing_eagerly() else iterator

    releasing = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                            "__doc__": cls.__doc__,
                                            "_tfpar_releases_iterators": True})
    return releasing


def releasing_iterators(dataset: Any) -> Any:
    """Returns ``dataset`` (a ``tf.distribute`` distributed dataset, or a ``tf.data.Dataset``
    read directly), its iterators freed in the background (:func:`release_in_background`).

    The dataset stays TensorFlow's object: its class becomes a subclass of its own class whose
    only change is ``__iter__``, so everything else (its type spec in ``tf.function``, its
    ``element_spec``, ``reduce``, ``isinstance`` checks) is TensorFlow's. No public API frees an
    iterator elsewhere or wakes the autotuning thread; applied on :data:`VERIFIED_TENSORFLOW`
    only (``tests/compat/iterator_release_test.py`` fails without it).
    """
    if skip_reason() is not None or getattr(dataset, "_tfpar_releases_iterators", False):
        return dataset
    try:
        dataset.__class__ = _releasing_class(dataset.__class__)
    except TypeError:  # A class whose layout forbids it: TensorFlow's behaviour, unchanged.
        pass
    return dataset
