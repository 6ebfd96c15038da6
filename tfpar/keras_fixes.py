"""Deprecated since 0.2.0 (removed in 0.3.0): moved to :mod:`tfpar.compat.keras_fixes`, with
every other version-gated workaround."""

import warnings

from tfpar.compat.keras_fixes import *  # noqa: F401,F403
from tfpar.compat.keras_fixes import FIXES  # noqa: F401
from tfpar.compat.keras_fixes import MODE_ENV  # noqa: F401
from tfpar.compat.keras_fixes import VERIFIED_KERAS  # noqa: F401

warnings.warn("tfpar.keras_fixes is deprecated and will be removed in tfpar 0.3.0: use "
              "tfpar.compat.keras_fixes.", DeprecationWarning, stacklevel=2)
