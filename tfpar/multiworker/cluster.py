"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.spec and tfpar.cluster.peers."""

import warnings

from tfpar.cluster.peers import *  # noqa: F401,F403
from tfpar.cluster.spec import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.cluster is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.spec and tfpar.cluster.peers.", DeprecationWarning, stacklevel=2)
