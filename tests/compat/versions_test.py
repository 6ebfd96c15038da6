"""Which TensorFlow and Keras builds tfpar's workarounds apply on (``tfpar.compat.versions``)."""

import os
import re
from unittest import mock

import tensorflow as tf

from tfpar.compat import versions

NEXT_RELEASES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), ".ci", "next_releases.txt")


class VersionsTest(tf.test.TestCase):

    def test_the_previews_are_the_builds_ci_pins(self):
        if not os.path.exists(NEXT_RELEASES):
            self.skipTest("not a checkout: .ci/next_releases.txt is not here")
        with open(NEXT_RELEASES, encoding="utf-8") as pins:
            pinned = dict(re.findall(r"^([\w-]+)==(\S+)$", pins.read(), re.MULTILINE))
        self.assertEqual(pinned, {"tensorflow": versions.PREVIEWS["tensorflow"],
                                  "keras-nightly": versions.PREVIEWS["keras"]})

    def test_releases_inside_the_range_and_the_exact_previews_are_verified(self):
        for version in ("3.0.0", "3.15.1", versions.PREVIEWS["keras"]):
            self.assertTrue(versions.keras_verified(version), version)
        for version in ("2.16.1", "2.21.0", "2.22.0-rc0", "2.22.0rc0"):
            self.assertTrue(versions.tensorflow_verified(version), version)

    def test_other_builds_of_the_next_minor_are_not(self):
        for version in ("3.16.0", "3.16.0.dev2026110101", "2.99.0"):
            self.assertFalse(versions.keras_verified(version), version)
        for version in ("2.22.0", "2.22.0rc1", "2.15.1"):
            self.assertFalse(versions.tensorflow_verified(version), version)

    def test_an_unverified_keras_names_the_range_and_the_escape_hatch(self):
        with mock.patch.dict(os.environ, {versions.KERAS_MODE_ENV: ""}):
            reason = versions.keras_skip_reason("3.16.0")
            self.assertIsNone(versions.keras_skip_reason(versions.PREVIEWS["keras"]))
        self.assertEqual(
            reason, "Keras 3.16.0 is outside the versions they were verified against (3.0 to "
            f"3.15, and the preview {versions.PREVIEWS['keras']}); set TFPAR_KERAS_FIXES=force "
            "to try them")
