"""Deprecated since 0.3.0, removed in 0.4.0: the multi-worker options live in
:mod:`tfpar.strategies.multi_worker_options` and the strategies are built by
:mod:`tfpar.strategies.multi_worker`."""

import warnings

from tfpar.strategies.multi_worker_options import IMPLEMENTATIONS  # noqa: F401

warnings.warn("tfpar.multiworker.strategy is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.strategies.multi_worker_options (IMPLEMENTATIONS) and "
              "tfpar.strategies.get('multi_worker', ...).", DeprecationWarning, stacklevel=2)


def check_steps_per_execution(steps_per_execution: int) -> None:
    """Deprecated: does nothing; ``steps_per_execution > 1`` runs across workers.

    Where it cannot (tfpar's fix of Keras's multi-step loop not applied), the strategies refuse
    it at the first step: :data:`tfpar.strategies.refusals.MULTI_STEP_EXECUTION`. Removed in
    0.4.0.

    Args:
        steps_per_execution: Unused.
    """
    del steps_per_execution
    warnings.warn("tfpar.multiworker.strategy.check_steps_per_execution is deprecated and does "
                  "nothing: steps_per_execution > 1 runs across workers, and "
                  "tfpar.strategies.refusals.MULTI_STEP_EXECUTION refuses it where it cannot. "
                  "It will be removed in 0.4.0.", DeprecationWarning, stacklevel=2)
