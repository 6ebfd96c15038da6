"""Every workaround of TensorFlow or Keras internals says the same way whether it applies
(``skip_reason()``), and every temporary class patch puts the class back as it was."""

import importlib
import pkgutil

import tensorflow as tf

import tfpar.compat
from tfpar.compat import class_patch
from tfpar.compat import versions

# Not workarounds: the gates themselves and the patch helper.
_HELPERS = {"versions", "class_patch"}


class GatesTest(tf.test.TestCase):

    def test_every_workaround_has_a_skip_reason_and_applies_on_the_verified_releases(self):
        names = [info.name for info in pkgutil.iter_modules(tfpar.compat.__path__)
                 if info.name not in _HELPERS]
        self.assertContainsSubset(["collective_keys", "coordination", "coordination_values",
                                   "iterator_release", "keras_distribution", "keras_fixes",
                                   "keras_internals", "mid_epoch_resume", "multi_worker_cpus",
                                   "onednn_state", "optimizer_apply"], names)
        for name in names:
            module = importlib.import_module(f"tfpar.compat.{name}")
            self.assertTrue(callable(getattr(module, "skip_reason", None)),
                            f"tfpar.compat.{name} has no skip_reason()")
            self.assertIsNone(module.skip_reason(), name)  # This suite runs verified releases.

    def test_a_tensorflow_outside_the_range_is_named(self):
        self.assertIsNone(versions.tensorflow_skip_reason(tf.__version__))
        self.assertEqual(versions.tensorflow_skip_reason("2.99.0"),
                         "TensorFlow 2.99.0 is outside " + versions.tensorflow_range_text())


class Base:
    inherited = "base"


class Patched(Base):
    own = "own"


class ClassPatchTest(tf.test.TestCase):

    def test_an_own_attribute_is_put_back_and_an_inherited_one_read_from_the_base_again(self):
        with class_patch.attribute_set(Patched, "own", 1), \
                class_patch.attribute_set(Patched, "inherited", 2):
            self.assertEqual((Patched.own, Patched.inherited), (1, 2))
        self.assertEqual(Patched.own, "own")
        self.assertNotIn("inherited", Patched.__dict__)
        Base.inherited = "changed"  # Read through the base again, not a copy of it.
        self.assertEqual(Patched.inherited, "changed")
        Base.inherited = "base"

    def test_put_back_when_the_block_raises(self):
        with self.assertRaises(KeyError), class_patch.attribute_set(Patched, "own", 1):
            raise KeyError("in the block")
        self.assertEqual(Patched.own, "own")
