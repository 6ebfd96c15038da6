"""Deprecated since 0.3.0, removed in 0.4.0: use tfpar.cluster.slurm."""

import warnings

from tfpar.cluster.slurm import *  # noqa: F401,F403

warnings.warn("tfpar.multiworker.slurm is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.cluster.slurm.", DeprecationWarning, stacklevel=2)
