"""The multi-worker entries' options and what they refuse, checked without TensorFlow (the
command line reads :data:`IMPLEMENTATIONS` and calls :func:`check_steps_per_execution` before
any slow work). The strategies themselves are built in :mod:`.multi_worker`."""

from __future__ import annotations

from tfpar.errors import ConfigError

IMPLEMENTATIONS = ("auto", "ring", "nccl")


def check_steps_per_execution(steps_per_execution: int) -> None:
    """Raises for several training steps per compiled call across workers.

    Keras runs them in a ``tf.while_loop`` whose steps sit in a ``tf.cond``; with a
    cross-worker collective inside, TensorFlow 2.21 fails at the first call ("You must feed a
    value for placeholder tensor 'while/cond/Placeholder'", for Keras's own step and tfpar's
    alike; keras-team/keras#19246). Refused before any work instead.

    Raises:
        ConfigError: If ``steps_per_execution`` is above 1.
    """
    if steps_per_execution > 1:
        raise ConfigError("{argument} > 1 does not run across workers (TensorFlow 2.21 / Keras "
                          "3.15 fail inside Keras's multi-step loop, keras-team/keras#19246). "
                          f"Use {{argument}}=1 with multi-worker strategies. Received: "
                          f"{{argument}}={steps_per_execution}.", argument="steps_per_execution")
