"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.failures."""

import warnings

from tfpar.cluster.failures import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.failures is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.failures.", DeprecationWarning, stacklevel=2)
