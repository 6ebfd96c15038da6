"""Command-line programs (absl flags). The only modules of tfpar that read ``FLAGS``."""

import os

# TensorFlow's C++ INFO lines (CUDA probing, oneDNN notices) drown a program's own output.
# Must be set before TensorFlow is imported; an explicit user setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from tfpar import lazy_exports  # noqa: E402

lazy_exports.install(__name__)
