"""The mirror of Keras's ``Optimizer.apply`` (``tfpar.compat.optimizer_apply``) against the
installed Keras, and the rule that private Keras and TensorFlow use lives in ``tfpar/compat/``."""

import inspect
import os
import re

import keras
import tensorflow as tf

from tfpar.compat import optimizer_apply
from tfpar.compat import versions
from tfpar.errors import ConfigError

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tfpar")

# Keras's private attributes that tfpar reads (tfpar.compat.keras_internals) or mirrors.
PRIVATE_KERAS_NAMES = [name for name in optimizer_apply.APPLY_METHODS if name.startswith("_")] + [
    "_iterations", "_accumulated_gradients", "_get_variable_index", "_trainable_variables",
    "_model_variables_moving_average", "_use_weight_decay", "_loss_tracker"]


class OptimizerApplyTest(tf.test.TestCase):

    def test_every_mirrored_method_exists_in_keras(self):
        installed = versions.major_minor(keras.version())
        missing = [name for name in optimizer_apply.APPLY_METHODS
                   if not hasattr(keras.optimizers.Optimizer, name)
                   and installed >= optimizer_apply.APPLY_METHODS_SINCE.get(name, (0, 0))]
        self.assertEqual(missing, [], "Keras renamed or removed what the mirror names")

    def test_keras_applies_in_the_mirrored_order(self):
        # BaseOptimizer.apply accumulates, then _backend_apply_gradients clips, decays,
        # updates, and keeps the moving averages: the order OptimizerUpdate follows.
        apply = inspect.getsource(keras.optimizers.Optimizer.apply)
        backend = inspect.getsource(keras.optimizers.Optimizer._backend_apply_gradients)
        self.assertIn("_backend_apply_gradients", apply)
        # Keras 3.16 overwrites through _backend_maybe_overwrite_model_variables (the same
        # condition, moved to the backend for a merge_call under tf.distribute).
        overwrite = ("_backend_maybe_overwrite_model_variables"
                     if hasattr(keras.optimizers.Optimizer,
                                "_backend_maybe_overwrite_model_variables")
                     else "_overwrite_model_variables_with_average_value")
        calls = ["_clip_gradients", "_apply_weight_decay", "_backend_update_step",
                 "_update_model_variables_moving_average", overwrite]
        positions = [backend.find(name) for name in calls]
        self.assertNotIn(-1, positions, backend)
        self.assertEqual(positions, sorted(positions), backend)

    def test_clipping_follows_keras(self):
        grads = [tf.constant([3.0, 4.0]), tf.constant([-10.0, 0.5])]
        for kwargs in ({"clipnorm": 1.0}, {"global_clipnorm": 2.0}, {"clipvalue": 0.7}, {}):
            optimizer = keras.optimizers.SGD(**kwargs)
            mirrored = optimizer_apply.clip(optimizer, grads)
            keras_clipped = optimizer._clip_gradients(grads)
            for ours, theirs in zip(mirrored, keras_clipped):
                self.assertAllClose(ours, theirs, msg=str(kwargs))

    def test_an_optimizer_that_changes_apply_is_named(self):
        self.assertEqual(optimizer_apply.overridden_methods(keras.optimizers.Adam()), [])
        self.assertEqual(optimizer_apply.overridden_methods(keras.optimizers.Nadam()),
                         ["_backend_update_step"])

    def test_an_unverified_keras_is_refused(self):
        previous = os.environ.get(versions.KERAS_MODE_ENV)
        os.environ[versions.KERAS_MODE_ENV] = "off"
        try:
            with self.assertRaisesRegex(
                    ConfigError, r"mirrors Keras's Optimizer\.apply as of Keras 3\.0 to 3\.\d+, "
                                 r"and the preview \S+; .*Use the 'mirrored'"):
                optimizer_apply.overridden_methods(keras.optimizers.SGD())
        finally:
            if previous is None:
                del os.environ[versions.KERAS_MODE_ENV]
            else:
                os.environ[versions.KERAS_MODE_ENV] = previous

    def test_private_upstream_use_lives_in_compat(self):
        patterns = [re.escape("keras.src"), re.escape("keras/src"),
                    re.escape("tensorflow.python"), re.escape("tensorflow.compiler")] + [
            r"[.'\"]" + re.escape(name) + r"\b" for name in PRIVATE_KERAS_NAMES]
        found = []
        for folder, _, files in os.walk(PACKAGE):
            if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == "compat":
                continue
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    found += [f"{os.path.relpath(path, PACKAGE)}: {p}" for p in patterns
                              if re.search(p, text)]
        self.assertEqual(found, [])


if __name__ == "__main__":
    tf.test.main()
