"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.private_network."""

import warnings

from tfpar.cluster.private_network import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.private_network is deprecated and will be removed in tfpar "
              "0.4.0: use tfpar.cluster.private_network.", DeprecationWarning, stacklevel=2)
