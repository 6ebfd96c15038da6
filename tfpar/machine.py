"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.host.machine`."""

import warnings

from tfpar.host.machine import *  # noqa: F401,F403

warnings.warn("tfpar.machine is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.host.machine.", DeprecationWarning, stacklevel=2)
