"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.launcher."""

import warnings

from tfpar.cluster.launcher import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.launcher is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.launcher.", DeprecationWarning, stacklevel=2)
