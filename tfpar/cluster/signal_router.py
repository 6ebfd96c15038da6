"""The one home of a process's signal handlers: handlers that only record, and subscribers.

Python runs a signal's handler in the main thread between two bytecodes, wherever that thread
is: inside a lock's critical section, an ``except`` or ``finally`` block, a ``wait``. A handler
that takes a lock can deadlock against the code it interrupted; one that raises can escape from
a finaliser as a traceback. The router's handlers do neither: they append the signal to a list
(atomic in CPython) and return. Code that cares asks :func:`take` at its own safe points (the
launcher's loop), or subscribes a callback (:func:`subscribe`) that a thread of the router's
calls as soon as the signal arrives, even while the main thread is blocked inside TensorFlow
(Python's C-level handler writes each signal's number to the wakeup descriptor the router
reads).

A subscription is installed for as long as its owner needs it (the launcher: from before its
first worker starts until the last exited) and given back with :func:`unsubscribe`, which puts
back the handlers found before it. Handlers can be set in the main thread only; elsewhere (a
Ray worker's training thread) subscribing does nothing and says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

_arrived: list[int] = []  # Signals recorded by the handlers, not taken yet.
_listeners: list[Callable[[int], None]] = []
_previous: list[dict[int, object]] = []  # Per subscription: the handlers it replaced.
_reader: list[int] = []  # The wakeup descriptor's reading end, once the reader runs.


def _record(signum, frame) -> None:
    """The handler: records the signal, nothing else."""
    _arrived.append(signum)


def in_main_thread() -> bool:
    """Whether this thread may set handlers (Python takes signals in the main thread only)."""
    return threading.current_thread() is threading.main_thread()


def subscribe(signals: Iterable[int],
              handler: Callable[[int, Any], None] | None = None) -> bool:
    """Routes ``signals`` to the router until :func:`unsubscribe`: each arrival reaches the
    listeners (:func:`on_arrival`) and is kept for :func:`take`, or given to ``handler``
    instead (one that only records, as the router's own does: no lock, no exception).
    Subscriptions nest.

    Returns:
        Whether the handlers were set (in the main thread only).
    """
    if not in_main_thread():
        return False
    _start_reader()
    _previous.append(install({s: handler or _record for s in signals}))
    return True


def install(handlers: Mapping[int, Any]) -> dict[int, Any]:
    """Sets each signal's handler (main thread only), returning those it replaced: the one
    place tfpar calls ``signal.signal``, for the few handlers that are not the router's own
    (a preemption notice's, the programs' Ctrl-C) and for putting handlers back.

    Returns:
        The handlers replaced, by signal (empty outside the main thread, where nothing is set).
    """
    if not in_main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}


def unsubscribe() -> None:
    """Gives back the handlers the innermost :func:`subscribe` replaced."""
    if not in_main_thread() or not _previous:
        return
    install(_previous.pop())


def take(only: int | None = None) -> list[int]:
    """The signals recorded and not taken yet, oldest first (``only``: just that one; the
    others stay recorded)."""
    taken: list[int] = []
    kept: list[int] = []
    while _arrived:
        signum = _arrived.pop(0)
        (taken if only is None or signum == only else kept).append(signum)
    _arrived[:0] = kept
    return taken


def pending() -> bool:
    """Whether a signal was recorded and not taken yet."""
    return bool(_arrived)


def on_arrival(listener: Callable[[int], None]) -> None:
    """Calls ``listener(signum)`` from the router's thread as soon as any signal that has a
    Python handler arrives (main thread only: it sets up the wakeup descriptor)."""
    _start_reader()
    _listeners.append(listener)


def _read_arrivals(read_end: int) -> None:
    while True:
        try:
            signum = os.read(read_end, 1)[0]
        except (OSError, IndexError):
            return
        for listener in list(_listeners):
            with contextlib.suppress(Exception):  # A listener's failure is its own.
                listener(signum)


def _start_reader() -> None:
    if _reader or not in_main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_read_arrivals, args=(read_end,), name="tfpar-signals",
                     daemon=True).start()
    _reader.append(read_end)


def reader_descriptor() -> int | None:
    """The wakeup descriptor's reading end (``None`` before the reader started)."""
    return _reader[0] if _reader else None
