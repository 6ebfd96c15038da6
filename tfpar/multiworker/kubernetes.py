"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.kubernetes."""

import warnings

from tfpar.cluster.kubernetes import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.kubernetes is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.kubernetes.", DeprecationWarning, stacklevel=2)
