"""Deprecated since 0.4.0, removed in 0.5.0: use :mod:`tfpar.callbacks.save_on_preemption`
(the name it shared with :mod:`tfpar.cluster.preemption`, where a notice is handled)."""

from tfpar import lazy_exports
from tfpar.callbacks.save_on_preemption import *  # noqa: F401,F403
from tfpar.callbacks.save_on_preemption import SaveOnPreemption  # noqa: F401

lazy_exports.warn_deprecated_alias(
    "tfpar.callbacks.preemption is deprecated and will be removed in tfpar 0.5.0: use "
    "tfpar.callbacks.save_on_preemption (or tfpar.callbacks.SaveOnPreemption).")
