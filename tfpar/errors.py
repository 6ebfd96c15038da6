"""The exceptions tfpar raises for bad input, so callers can tell user errors from bugs.

Every message says what was wrong and what is allowed. Scripts catch :class:`TfparError`
and print its message without a traceback. A message about one argument names it through the
``{argument}`` placeholder, so the library says ``data_dir`` and a command line, which knows
its flags, says ``--data_dir`` (:meth:`TfparError.render`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class ExitStatus(enum.IntEnum):
    """Every status tfpar's programs (``tfpar-train``, ``-benchmark``, ``-env``, ``-launch``)
    end with, besides 128 + N for a process killed by signal N (which the launcher passes on
    for a worker killed so).

    Chosen so that a scheduler's script can tell what to do: run again as it is (85), run
    again after fixing what the line said (2), after the machines or the folder are back (69,
    74), at once with other ports (75).
    """

    SUCCESS = 0
    """Done."""
    CRASHED = 1
    """An unexpected failure: Python's traceback says where (a bug, or TensorFlow's own)."""
    BAD_INPUT = 2
    """Bad input, said in one line: the same command fails the same way again."""
    PEER_UNAVAILABLE = 69
    """A peer worker did not come up, or stopped answering (EX_UNAVAILABLE)."""
    STATE_NOT_SAVED = 74
    """The training state could not be written; the last one saved is intact (EX_IOERR)."""
    PORT_TAKEN = 75
    """A worker's port was taken by another program (EX_TEMPFAIL)."""
    PREEMPTED = 85
    """Stopped for a preemption notice after saving: run the same command to resume."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C (or SIGTERM where it is no preemption notice)."""


SIGNALLED = 128
"""A process killed by signal N ends with ``SIGNALLED + N`` (137 for SIGKILL), as shells say."""


class TfparError(ValueError):
    """Base class of tfpar's user-facing errors (bad arguments, impossible requests).

    Args:
        message: What was wrong and what is allowed; ``{argument}`` where it names the
            argument at fault.
        argument: The name of the library argument at fault, if one is.

    Attributes:
        exit_status: The status tfpar's programs exit with on this error.
        argument: The argument at fault, or ``None``.
    """

    exit_status: int = ExitStatus.BAD_INPUT

    def __init__(self, message: str, *, argument: str | None = None):
        self.template, self.argument = message, argument
        super().__init__(self.render(lambda name: name))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with the argument called ``name_of(argument)`` (e.g. its flag)."""
        if self.argument is None:
            return self.template
        return self.template.replace("{argument}", name_of(self.argument))


class DeviceError(TfparError):
    """A device set cannot be provided (unknown device, too many, too late to split)."""


class RegistryError(TfparError):
    """An unknown or duplicate registry name, or an option an entry does not accept."""


class DatasetError(TfparError):
    """A dataset cannot be loaded, or does not fit the model."""


class ConfigError(TfparError):
    """A training configuration value is out of range."""


class OptionValueError(ConfigError):
    """A registry entry's option has a value it does not allow (an unknown algorithm, NCCL
    without GPUs): a :class:`ConfigError`, like every value out of range."""


RUN_TIME_REFUSAL = "tfpar cannot run this step: "
"""How a refusal that only a step's data can reveal begins (a ``tf.debugging`` assertion inside
the compiled step, whose error TensorFlow raises as ``tf.errors.InvalidArgumentError``); ``fit``
raises it as a :class:`ConfigError` with that line (:func:`run_time_refusal`)."""


def run_time_refusal(message: str) -> str | None:
    """The one line of a refusal raised inside a compiled step, found in the text of
    TensorFlow's error (``None``: the error is no such refusal)."""
    start = message.find(RUN_TIME_REFUSAL)
    if start < 0:
        return None
    line = message[start + len(RUN_TIME_REFUSAL):].splitlines()[0]
    # TensorFlow's text of an assertion holds its message in brackets, ``[line] [Condition...``,
    # and tf.debugging.assert_* end it with one period more.
    line = line.split("]")[0].strip()
    return line[:-1] if line.endswith("..") else line


class ClusterError(TfparError):
    """A multi-worker cluster specification is malformed or inconsistent."""


class PortTakenError(ClusterError):
    """This worker's port is in use by another program (a launcher retries with new ports)."""

    exit_status = ExitStatus.PORT_TAKEN  # Trying again (with other ports) may succeed.


class PeerUnreachableError(ClusterError):
    """A peer of the cluster did not come up (or its packets went nowhere) within the wait."""

    exit_status = ExitStatus.PEER_UNAVAILABLE  # The job can run once every worker is up.


class PeerLostError(ClusterError):
    """A worker of a multi-worker job stopped answering during training.

    Args:
        message: The one line.
        unresponsive: The indices of the workers that stopped answering, where known.
    """

    exit_status = ExitStatus.PEER_UNAVAILABLE  # Resumable once every worker runs again.

    def __init__(self, message: str, *, unresponsive: tuple[int, ...] = ()):
        super().__init__(message)
        self.unresponsive = tuple(unresponsive)


class DamagedStateError(ConfigError):
    """A saved training state's file is missing, damaged, or not the one its save wrote (a
    truncated or emptied file, another save's or another worker's): the message names the
    file. Restoring refuses it rather than resume from something else than what was saved."""


class StateNotSavedError(TfparError):
    """The training state of an epoch could not be written (a full disk, a quota, a folder
    that became read-only); the previously saved epoch is intact and is where a rerun
    resumes."""

    exit_status = ExitStatus.STATE_NOT_SAVED  # Resumable once the folder takes writes again.


class NonFiniteLossError(TfparError):
    """Training stopped because the loss became NaN or infinite.

    Attributes:
        results: What was measured before it stopped (``RunResult`` objects), the stopped run
            last.
    """

    def __init__(self, message: str, results: list, *, argument: str | None = None):
        super().__init__(message, argument=argument)
        self.results = results


class InexactUpdateWarning(UserWarning):
    """Training runs, but its update is not the one a single device computes (e.g. gradient
    clipping under Keras's step with several replicas); the message names the exact
    alternative."""
