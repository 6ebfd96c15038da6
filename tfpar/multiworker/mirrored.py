"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.strategies.multi_worker`."""

import warnings

from tfpar.strategies.multi_worker import MultiWorkerStrategy  # noqa: F401

warnings.warn("tfpar.multiworker.mirrored is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.strategies.multi_worker (MultiWorkerStrategy).", DeprecationWarning,
              stacklevel=2)
