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

tfpar's programs (``tfpar-train``, ``tfpar-launch``, ...) record a scheduler's notices from the
moment ``import tfpar`` begins (:func:`record_early`, the first thing the package runs), before
their heavy imports; the program's first watch for notices takes them over
(:func:`take_early`). Only the interpreter's own start-up, before that import, ends a program
on a notice without a word (143). A program of the user's that imports tfpar keeps its own
signals.

A subscription is installed for as long as its owner needs it (the launcher: from before its
first worker starts until the last exited) and given back with :func:`unsubscribe`, which puts
back the handlers found before it. Handlers can be set in the main thread only; elsewhere (a
Ray worker's training thread) subscribing does nothing and says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

_arrived: list[int] = []  # Signals recorded by the handlers, not taken yet.
_early: list[int] = []  # Notices recorded before the program watched for them.
_early_replaced: dict[int, Any] = {}  # The handlers the early recording replaced.

PROGRAMS = ("tfpar-train", "tfpar-launch", "tfpar-benchmark", "tfpar-env")
"""tfpar's console programs, which record notices from their first import of tfpar."""
_PROGRAM_MODULES = tuple(f"tfpar.cli.{name.split('-')[1]}" for name in PROGRAMS)
_CHECKOUT_SCRIPTS = ("train.py", "launch.py", "benchmark.py")  # A checkout's programs.
EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The notices recorded early: those every program watches until it reads its flags."""
_listeners: list[Callable[[int], None]] = []
_previous: list[dict[int, object]] = []  # Per subscription: the handlers it replaced.
_reader: list[int] = []  # The wakeup descriptor's reading end, once the reader runs.


def _record(signum, frame) -> None:
    """The handler: records the signal, nothing else."""
    _arrived.append(signum)


def _record_early(signum, frame) -> None:
    """The early handler: records the notice for the program's first watch, nothing else."""
    _early.append(signum)


def is_program(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether this process runs one of tfpar's programs: a console script of
    :data:`PROGRAMS`, ``python -m tfpar.cli.X``, or a checkout's own program files.

    Args:
        argv: ``sys.argv``.
        orig_argv: ``sys.orig_argv`` (the interpreter's own arguments, ``-m`` included).
    """
    options = iter(orig_argv[1:])  # The interpreter's options, up to its script or -m/-c.
    script = None
    for option in options:
        if option == "--check-hash-based-pycs":
            next(options, None)  # Its value.
            continue
        if option.startswith("--"):
            continue
        if not option.startswith("-") or option == "-":
            script = option  # The script: argv[0].
            break
        # Short options combine as CPython reads them ("-um X", "-Bu -m X", "-uWignore"): -c,
        # -m, -W and -X take the rest of the word as their value, else the next word.
        for at, letter in enumerate(option[1:], start=2):
            if letter in "cmWX":
                value = option[at:] or next(options, "")
                if letter == "m":
                    return value in _PROGRAM_MODULES
                if letter == "c":
                    return False
                break
    path = argv[0] if argv and argv[0] else script
    if not path:
        return False
    if os.path.basename(path) in PROGRAMS:
        return True
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    scripts = {os.path.realpath(os.path.join(root, "scripts", name))
               for name in _CHECKOUT_SCRIPTS}
    return os.path.realpath(path) in scripts


def command_runs_program(command: Sequence[str]) -> bool:
    """Whether a command line (the launcher's workers') runs one of tfpar's programs, which
    record notices from their first import of tfpar: ``tfpar-X ...``, or a Python interpreter
    running one (``python -m tfpar.cli.X``, a console script, a checkout's own program file).
    A wrapper before it (``env X=1``, ``uv run --``, ``srun``) is looked past: the first
    word that is one of tfpar's programs or a Python interpreter decides. Anything else (a
    user's program) keeps its own signals."""
    for at, word in enumerate(command):
        name = os.path.basename(word)
        if name in PROGRAMS:
            return True
        if re.fullmatch(r"python[0-9.]*", name):
            return is_program([], command[at:])
    return False


def record_early() -> bool:
    """In one of tfpar's programs (:func:`is_program`), records the notices of
    :data:`EARLY_SIGNALS` from now on (called first thing at ``import tfpar``), until the
    program watches for them (:func:`take_early`). Elsewhere it does nothing.

    Returns:
        Whether the early recording was installed.
    """
    if (_early_replaced or not in_main_thread()
            or not is_program(sys.argv, getattr(sys, "orig_argv", sys.argv))):
        return False
    _early_replaced.update(install({s: _record_early for s in EARLY_SIGNALS}))
    return True


def take_early(signals: Iterable[int]) -> list[int]:
    """Ends the early recording of ``signals``, once the caller has set its own handlers for
    them (:func:`subscribe`): where the early handler would be given back later, the handler
    it replaced is; returns the notices of ``signals`` recorded early, oldest first."""
    wanted = set(signals)
    for saved in _previous:
        for signum in wanted:
            if saved.get(signum) is _record_early:
                saved[signum] = _early_replaced.get(signum, signal.SIG_DFL)
    taken = [s for s in _early if s in wanted]
    _early[:] = [s for s in _early if s not in wanted]
    return taken


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
