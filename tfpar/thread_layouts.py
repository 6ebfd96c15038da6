"""Deprecated since 0.3.0, removed in 0.4.0: use :mod:`tfpar.host.thread_layouts`."""

import warnings

from tfpar.host.thread_layouts import *  # noqa: F401,F403

warnings.warn("tfpar.thread_layouts is deprecated and will be removed in tfpar 0.4.0: use "
              "tfpar.host.thread_layouts.", DeprecationWarning, stacklevel=2)
