"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.training.evaluation`."""

import warnings

from tfpar.training.evaluation import *  # noqa: F401,F403

warnings.warn("tfpar.evaluation is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.training.evaluation.", DeprecationWarning, stacklevel=2)
