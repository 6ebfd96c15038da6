"""Pieces shared by tfpar's command-line programs: user errors without tracebacks, parsing."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

from absl import app
from absl import flags

from tfpar import config_fields
from tfpar import worker_contract
from tfpar.cluster import preemption
from tfpar.cluster import signal_router
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus
from tfpar.errors import TfparError

if TYPE_CHECKING:
    from tfpar.strategies import StrategyChoice

INTERRUPTED = ("Interrupted. Result files are untouched or complete; with --model_dir, the "
               "last saved state is there: run the same command to resume.")
# After Ctrl-C (or SIGTERM where it is no preemption notice), how long the program may take to
# stop by itself before it is ended: its main thread can be blocked in TensorFlow (a collective
# waiting for a worker that has already stopped), where Python cannot raise KeyboardInterrupt.
STOP_GRACE_SECONDS = 5.0
_reported = threading.Event()  # The interruption was reported by the main thread.
_running = threading.Event()  # A wrapped main is running (the watcher acts only then).
_watching: list = []  # The watcher runs (once per process).


def flag_name(argument: str, aliases: dict[str, str] | None = None) -> str:
    """The flag a library argument is set by: ``--name`` (or its alias), else the argument."""
    flag = (aliases or {}).get(argument, argument)
    return f"--{flag}" if flag in flags.FLAGS else argument


def exit_cleanly(main: Callable[[list[str]], Any],
                 aliases: dict[str, str] | None = None) -> Callable[[list[str]], Any]:
    """Wraps an absl ``main``: a user error prints one line and exits with status 2 (or the
    error's ``exit_status``); Ctrl-C (and SIGTERM, unless ``main`` watches it as a preemption
    notice) stops it with status 130.

    A library error about an argument names the flag that sets it (``--data_dir`` for
    ``data_dir``; ``aliases`` maps arguments to flags of other names).
    """

    @functools.wraps(main)
    def wrapped(argv):
        # SIGTERM stops the program as Ctrl-C does (files are written atomically, so only
        # complete results and checkpoints are left behind), unless it is watched as a
        # preemption notice (tfpar.cluster.preemption: every program from run_main's start).
        previous = (None if preemption.NOTICE.watching(signal.SIGTERM)
                    else signal_router.install({signal.SIGTERM: _raise_keyboard_interrupt}))
        _end_if_stuck_after_signal()
        _running.set()
        try:
            result = main(argv)
            worker_contract.record_stop(ExitStatus.SUCCESS)
            return result
        except TfparError as e:
            line = f"Error: {e.render(lambda a: flag_name(a, aliases))}"
            print(line, file=sys.stderr)
            # Said in its one line, the program is ending: a Ctrl-C now (a launcher stopping
            # the other workers) would print a traceback from the exit's clean-up instead.
            signal_router.install({signal.SIGINT: signal.SIG_IGN})
            worker_contract.record_stop(e.exit_status, line,
                                 unresponsive=getattr(e, "unresponsive", ()))
            sys.exit(e.exit_status)
        except KeyboardInterrupt:
            print(INTERRUPTED, file=sys.stderr, flush=True)
            _reported.set()
            worker_contract.record_stop(ExitStatus.INTERRUPTED, INTERRUPTED)
            sys.exit(ExitStatus.INTERRUPTED)
        except SystemExit:
            raise
        except BaseException as e:
            worker_contract.record_stop(ExitStatus.CRASHED, f"{type(e).__name__}: {e}")
            raise
        finally:
            _running.clear()
            if previous is not None:
                signal_router.install(previous)

    return wrapped


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _end_if_stuck_after_signal() -> None:
    """Ends the process STOP_GRACE_SECONDS after Ctrl-C (or a SIGTERM that is no preemption
    notice) if it has not stopped by then."""
    if _watching:
        return
    _watching.append(True)

    def end_later() -> None:
        time.sleep(STOP_GRACE_SECONDS)
        if _running.is_set():  # The main thread did not get out by itself.
            if not _reported.is_set():
                print(f"{INTERRUPTED} (Stopped while waiting inside TensorFlow.)",
                      file=sys.stderr, flush=True)
            worker_contract.record_stop(ExitStatus.INTERRUPTED, INTERRUPTED)
            os._exit(ExitStatus.INTERRUPTED)

    def on_arrival(signum: int) -> None:
        # Only where the signal interrupts (a preemption notice, or the launcher's own
        # handling of one, has a budget of its own).
        if _running.is_set() and signal.getsignal(signum) in (_raise_keyboard_interrupt,
                                                              signal.default_int_handler):
            threading.Thread(target=end_later, name="tfpar-stop-watch", daemon=True).start()

    signal_router.on_arrival(on_arrival)


def grouped_help(doc: str, groups: dict[str, tuple[str, ...]]) -> str:
    """Returns ``--help`` text: ``doc``, then each group's flags with help and default."""
    lines = [config_fields.plain_text(doc.strip()), ""]
    for title, names in groups.items():
        lines.append(f"{title}:")
        for name in names:
            flag = flags.FLAGS[name]
            prefix = "[no]" if isinstance(flag, flags.BooleanFlag) else ""
            default = flag.default_as_str or "none"
            lines.append(textwrap.fill(f"--{prefix}{name}: {flag.help} (default: {default})",
                                       width=100, initial_indent="  ",
                                       subsequent_indent="      "))
        lines.append("")
    lines.append("Also: --helpfull for absl's own flags.")
    return "\n".join(lines)


def run_main(main: Callable[[list[str]], Any], flags_module: str,
             help_groups: dict[str, tuple[str, ...]] | None = None,
             aliases: dict[str, str] | None = None, positional: bool = False) -> None:
    """Runs an absl ``main`` whose flags live in ``flags_module``, with user errors handled.

    absl's ``--help`` lists the key flags of the program file (``sys.argv[0]``); the flags of
    tfpar's programs live in importable modules (so a checkout's scripts and the console
    scripts share them), so they are declared key flags of whichever file was run. Flags are
    parsed before TensorFlow is imported (the programs import it in ``main``), so ``--help``
    and flag errors answer at once; ``--help`` exits with status 0 (grouped as
    ``help_groups`` says, if given).
    Library errors name the flags of their arguments (``aliases``: arguments whose flag has
    another name). Positional arguments are refused (exit 2) unless ``positional``.
    """
    # From the program's first import of tfpar (recorded there, taken over here), a
    # scheduler's notice (SIGTERM, SIGUSR1) is a notice: before training it ends the program
    # with the preempted status and its stop record, not as an interruption (130), which a
    # scheduler does not requeue. The train command narrows the signals to its
    # --preemption_signal once its flags are read.
    preemption.NOTICE.watch(preemption.notice_signals(preemption.DEFAULT_NOTICE_SIGNAL),
                             exit_process=True)
    for flag in flags.FLAGS.get_key_flags_for_module(flags_module):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    if any(arg in ("-h", "--help", "-?", "--helpshort") for arg in sys.argv[1:]):
        if help_groups:
            print(grouped_help(sys.modules[flags_module].__doc__ or "", help_groups))
            sys.exit(0)
        app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
    if "--helpfull" in sys.argv[1:]:  # Every flag, absl's own too (app.run is not reached).
        app.usage(shorthelp=False, writeto_stdout=True, exitcode=0)
    try:  # absl would exit 1 with a FATAL line; every bad input exits 2 with one line.
        extra = flags.FLAGS(sys.argv)[1:]
        if extra and not positional:
            raise flags.Error(f"Unexpected arguments: {' '.join(extra)}. The program takes "
                              "flags only (--name=value)")
    except flags.Error as e:
        message = str(e).strip()
        end = " " if message.endswith(("?", ".")) else ". "
        print(f"Error: {message}{end}Run with --help to see the flags.", file=sys.stderr)
        sys.exit(2)
    # TensorFlow's Python logger (tf.get_logger()) repeats every cross-device reduction it
    # sets up at INFO; set without importing TensorFlow.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    app.run(exit_cleanly(main, aliases))


def parse_count(flag: str, text: str, least: int = 1, most: int | None = None) -> int:
    """Parses an integer flag item from ``least`` to ``most``, e.g. one entry of
    ``--num_devices``.

    Raises:
        ConfigError: If ``text`` is not an integer in that range.
    """
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        kind = "positive integers such as 1,2" if least == 1 else f"integers >= {least}"
        raise ConfigError(f"{flag} takes {kind}. Received: {text!r}.")
    if most is not None and value > most:
        raise ConfigError(f"{flag} takes integers from {least} to {most}. Received: {text!r}.")
    return value


def strategy_choice(strategy: str, values: dict[str, Any],
                    flag_names: dict[str, str] | None = None) -> StrategyChoice:
    """Resolves ``--strategy`` and the option flags its registry entry takes into the run's
    :class:`tfpar.strategies.StrategyChoice`.

    Args:
        strategy: The registry name.
        values: Option name to flag value (of every strategy's options).
        flag_names: Option name to flag name, where they differ.

    Raises:
        RegistryError: If the strategy is unknown.
        ConfigError: If a flag was given on the command line that the strategy does not take.
    """
    from tfpar import strategies  # Registered plugins may import TensorFlow.

    choice = strategies.choose(strategy)
    accepted = choice.options
    flag_names = flag_names or {}
    for option in values:
        flag = flag_names.get(option, option)
        if option not in accepted and flags.FLAGS[flag].present:
            takes = ", ".join(f"--{flag_names.get(name, name)}" for name in accepted)
            raise ConfigError(f"--{flag} does not apply to strategy {strategy!r}; the flags it "
                              f"takes are: {takes or 'none of the strategy flags'}.")
    return choice.with_options(**{k: v for k, v in values.items() if k in accepted})


def strategy_listing(flag_names: dict[str, str] | None = None) -> str:
    """Returns the registered strategies, one ``name: description (flags: --a, --b)`` per line.

    Args:
        flag_names: Option name to flag name, where they differ.
    """
    from tfpar import strategies

    flag_names = flag_names or {}

    def its_flags(name: str) -> str:
        options = strategies.entry(name).options()
        return ", ".join(f"--{flag_names.get(option, option)}" for option in options) or "none"

    return "\n".join(f"{name}: {description} (flags: {its_flags(name)})"
                     for name, description in strategies.available().items())
