"""The exceptions tfpar raises for bad input, so callers can tell user errors from bugs.

Every message says what was wrong and what is allowed. Scripts catch :class:`TfparError`
and print its message without a traceback.
"""


class TfparError(ValueError):
    """Base class of tfpar's user-facing errors (bad arguments, impossible requests).

    Attributes:
        exit_status: The status tfpar's programs exit with on this error.
    """

    exit_status = 2


class DeviceError(TfparError):
    """A device set cannot be provided (unknown device, too many, too late to split)."""


class RegistryError(TfparError):
    """An unknown or duplicate registry name, or an option an entry does not accept."""


class DatasetError(TfparError):
    """A dataset cannot be loaded, or does not fit the model."""


class ConfigError(TfparError):
    """A training configuration value is out of range."""


class ClusterError(TfparError):
    """A multi-worker cluster specification is malformed or inconsistent."""


class PortTakenError(ClusterError):
    """This worker's port is in use by another program (a launcher retries with new ports)."""

    exit_status = 75  # EX_TEMPFAIL: trying again (with other ports) may succeed.


class NonFiniteLossError(TfparError):
    """Training stopped because the loss became NaN or infinite.

    Attributes:
        results: What was measured before it stopped (``RunResult`` objects), the stopped run
            last.
    """

    def __init__(self, message: str, results: list):
        super().__init__(message)
        self.results = results
