"""Whether TensorFlow runs its oneDNN kernels, read back from TensorFlow itself.

TensorFlow decides once, as it starts (``IsMklEnabled`` in ``tensorflow/core/util/port.cc``:
``TF_ENABLE_ONEDNN_OPTS`` read as ``ReadBoolFromEnvVar`` reads it, else its default rule), and
its private ``_pywrap_util_port.IsMklEnabled`` (what TensorFlow's own tests ask, through
``test_util.IsMklEnabled``) returns that decision. :func:`tensorflow_runs_onednn` asks it on
the TensorFlow versions of :data:`~tfpar.compat.versions.VERIFIED_TENSORFLOW` only (the
private module is imported behind that gate), and only once TensorFlow was imported: asking
never starts it.
"""

from __future__ import annotations

import importlib
import sys

from tfpar.compat import versions

_PACKAGE = "tensorflow.python.util"
_MODULE = "_pywrap_util_port"
_MEMBER = "IsMklEnabled"


def skip_reason() -> str | None:
    """Why TensorFlow cannot be asked whether it runs oneDNN here (``None``: it can)."""
    return versions.tensorflow_member_skip_reason(_PACKAGE, _MODULE, _MEMBER)


def tensorflow_runs_onednn() -> bool | None:
    """Whether the TensorFlow of this process runs its oneDNN kernels, as it decided when it
    started; ``None`` where it has not been imported, or cannot be asked on this version."""
    if "tensorflow" not in sys.modules:
        return None
    try:
        if skip_reason() is not None:
            return None
        return bool(getattr(getattr(importlib.import_module(_PACKAGE), _MODULE), _MEMBER)())
    except (ImportError, AttributeError):
        return None
