"""Deprecated since 0.3.0, removed in 0.4.0: moved to :mod:`tfpar.cluster` (``cluster`` split
into :mod:`tfpar.cluster.spec` and :mod:`tfpar.cluster.peers`)."""

import warnings

from tfpar import lazy_exports

warnings.warn("tfpar.multiworker is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.", DeprecationWarning, stacklevel=2)

lazy_exports.install(__name__)
