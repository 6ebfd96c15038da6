"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.benchmark.measurements`."""

import warnings

from tfpar.benchmark.measurements import *  # noqa: F401,F403

warnings.warn("tfpar.benchmark.configuration is deprecated and will be removed in tfpar 0.4.0: "
              "use tfpar.benchmark.measurements.", DeprecationWarning, stacklevel=2)
