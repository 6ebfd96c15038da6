"""Version gates: which Keras releases tfpar's Keras workarounds were verified against.

No TensorFlow or Keras import at module level: :mod:`tfpar.env` reads this to report.
"""

from __future__ import annotations

import os

# (major, minor) versions of Keras the workarounds that touch Keras internals were verified
# against, inclusive: the code they rely on is unchanged from 3.0 to 3.15 (read in their
# sources); the suite ran on 3.15.1. setup.cfg caps Keras at the same release.
VERIFIED_KERAS = ((3, 0), (3, 15))
# (major, minor) versions of TensorFlow the TensorFlow workarounds were verified against,
# inclusive: those setup.cfg allows (measured on 2.21).
VERIFIED_TENSORFLOW = ((2, 16), (2, 21))
# The previews of the next releases the whole README test command runs on in CI, exactly these
# builds (`.ci/next_releases.txt` pins them; a test holds the two together). The workarounds
# apply on them as on the verified releases; other builds of the same minor stay unverified
# until their final release passes.
PREVIEWS = {"tensorflow": "2.22.0rc0", "keras": "3.16.0.dev2026102704"}
# "force": use the workarounds on any Keras (to check a new release, see DEVELOPERS.md);
# "off": never. Unset: only on VERIFIED_KERAS and the Keras of PREVIEWS.
KERAS_MODE_ENV = "TFPAR_KERAS_FIXES"


def major_minor(version: str) -> tuple[int, int]:
    """Returns ``(major, minor)`` of a version string such as ``"2.21.0"`` or ``"3.16rc0"``.

    Args:
        version: A release or prerelease version string.

    Returns:
        The major and minor numbers (a prerelease is read by its minor's leading digits).
    """
    major, minor = version.split(".")[:2]
    digits = len(minor) - len(minor.lstrip("0123456789"))
    return int(major), int(minor[:digits] or 0)


def same_release(version: str, other: str) -> bool:
    """Whether two version strings name one build (``"2.22.0-rc0"`` is ``"2.22.0rc0"``)."""
    return version.replace("-", "").lower() == other.replace("-", "").lower()


def keras_verified(keras_version: str) -> bool:
    """Whether ``keras_version`` is in :data:`VERIFIED_KERAS` or is the Keras preview CI runs."""
    low, high = VERIFIED_KERAS
    return (low <= major_minor(keras_version) <= high
            or same_release(keras_version, PREVIEWS["keras"]))


def keras_range_text() -> str:
    """The verified Keras range as text, e.g. ``"3.0 to 3.15, and the preview 3.16.0.dev1"``."""
    (low, high) = VERIFIED_KERAS
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}, and the preview {PREVIEWS['keras']}"


def tensorflow_verified(tensorflow_version: str) -> bool:
    """Whether ``tensorflow_version`` is in :data:`VERIFIED_TENSORFLOW` or is the TensorFlow
    preview CI runs (:data:`PREVIEWS`)."""
    low, high = VERIFIED_TENSORFLOW
    return (low <= major_minor(tensorflow_version) <= high
            or same_release(tensorflow_version, PREVIEWS["tensorflow"]))


def tensorflow_range_text() -> str:
    """The verified TensorFlow range as text, e.g. ``"2.16 to 2.21, and the preview 2.22.0rc0"``."""
    (low, high) = VERIFIED_TENSORFLOW
    return (f"{low[0]}.{low[1]} to {high[0]}.{high[1]}, "
            f"and the preview {PREVIEWS['tensorflow']}")


def tensorflow_skip_reason(tensorflow_version: str) -> str | None:
    """Why TensorFlow workarounds are not used on ``tensorflow_version`` (``None``: they are).

    Args:
        tensorflow_version: ``tf.__version__``.

    Returns:
        ``None`` inside the verified range (or on the preview CI runs); otherwise the reason, in
        words for a log line or an error.
    """
    if tensorflow_verified(tensorflow_version):
        return None
    return f"TensorFlow {tensorflow_version} is outside {tensorflow_range_text()}"


def tensorflow_member_skip_reason(module: str, owner: str, member: str) -> str | None:
    """Why a workaround that uses ``owner.member`` of TensorFlow's private ``module`` does not
    apply here (``None``: it does). The module is imported only inside the verified range.

    Args:
        module: The private module, e.g. ``"tensorflow.python.distribute.cross_device_utils"``.
        owner: The class in it.
        member: The attribute of the class the workaround sets.

    Returns:
        ``None``, or the reason in words for a log line or an error.
    """
    import importlib

    import tensorflow as tf

    if not tensorflow_verified(tf.__version__):
        return (f"TensorFlow {tf.__version__} is outside the versions it was verified against "
                f"({tensorflow_range_text()})")
    if not hasattr(getattr(importlib.import_module(module), owner), member):
        return f"TensorFlow {tf.__version__} has no {owner}.{member}"
    return None


def keras_skip_reason(keras_version: str) -> str | None:
    """Why Keras workarounds are not used on ``keras_version`` (``None``: they are).

    Args:
        keras_version: ``keras.version()``.

    Returns:
        ``None`` inside the verified range or with ``TFPAR_KERAS_FIXES=force``; otherwise the
        reason, in words for a log line or an error.
    """
    mode = os.environ.get(KERAS_MODE_ENV, "")
    if mode == "off":
        return f"{KERAS_MODE_ENV}=off"
    if mode == "force":
        return None
    if not keras_verified(keras_version):
        return (f"Keras {keras_version} is outside the versions they were verified against "
                f"({keras_range_text()}); set {KERAS_MODE_ENV}=force to try them")
    return None
