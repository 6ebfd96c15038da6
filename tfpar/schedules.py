"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.training.schedules`."""

import warnings

from tfpar.training.schedules import *  # noqa: F401,F403

warnings.warn("tfpar.schedules is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.training.schedules.", DeprecationWarning, stacklevel=2)
