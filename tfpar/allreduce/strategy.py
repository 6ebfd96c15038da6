"""Deprecated since 0.2.0 (removed in 0.3.0): the all-reduce strategies moved to
:mod:`tfpar.strategies.allreduce`, with every other strategy class."""

import warnings

from tfpar.strategies.allreduce import AllReduceStrategy  # noqa: F401
from tfpar.strategies.allreduce import MultiWorkerAllReduceStrategy  # noqa: F401

warnings.warn("tfpar.allreduce.strategy (and tfpar.allreduce.AllReduceStrategy, "
              "MultiWorkerAllReduceStrategy) is deprecated and will be removed in tfpar 0.3.0: "
              "use tfpar.strategies.allreduce.", DeprecationWarning, stacklevel=2)
