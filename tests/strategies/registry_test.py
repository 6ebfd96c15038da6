"""Tests of the registry: user entries, entry points, errors; listing without TensorFlow."""

import warnings
from importlib import metadata
from unittest import mock

import tensorflow as tf

from tfpar import strategies
from tfpar import testing
from tfpar.compat import keras_fixes
from tfpar.errors import RegistryError
from tfpar.strategies import registry
from tfpar.strategies.base import TfparStrategy


class MyMirroredStrategy(TfparStrategy, tf.distribute.MirroredStrategy):
    """A user's strategy class."""


class RegisterTest(testing.StrategyTestCase):

    def tearDown(self):
        for name in ("mine", "plugin_strategy"):
            if name in strategies.available():
                strategies.unregister(name)
        super().tearDown()

    def test_register_as_decorator_and_get(self):
        @strategies.register("mine", description="My strategy.")
        def mine(devices, scale: int = 1):
            return MyMirroredStrategy(devices.tf_names)

        self.assertEqual(strategies.available()["mine"], "My strategy.")
        self.assertEqual(strategies.entry("mine").options(), {"scale": 1})
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            strategy = strategies.get("mine", 2, scale=3)
        self.assertEqual(strategy.num_replicas_in_sync, 2)
        self.assertEqual(strategies.selection(strategy).options, {"scale": 3})
        self.assertTrue(callable(mine))

    def test_a_choice_is_resolved_once_and_builds_what_get_builds(self):
        choice = strategies.choose("allreduce", accumulation_steps=2)
        self.assertEqual((choice.name, choice.micro_batches, choice.multi_process),
                         ("allreduce", 2, False))
        self.assertEqual(choice.options["algorithm"], "collective")  # The default filled in.
        with self.assertRaises(TypeError):
            choice.options["algorithm"] = "ring"  # A value: read-only.
        self.assertEqual(choice.with_options(algorithm="ring").options["algorithm"], "ring")
        self.assertEqual(choice.virtual_replicas, 0)
        self.assertEqual(strategies.choose("multi_worker_allreduce",
                                           virtual_replicas=4).virtual_replicas, 4)
        self.assertEqual(strategies.choose("mirrored").virtual_replicas, 0)  # No such option.
        with self.assertRaisesRegex(RegistryError, r"Strategy 'allreduce' has no option\(s\) "
                                                   r"colour\. Its options: algorithm, "):
            choice.with_options(colour="red")
        strategy = choice.build(2)
        self.assertEqual(strategy.num_replicas_in_sync, 2)
        self.assertEqual(strategies.selection(strategy).options, dict(choice.options))

    def test_tensorflows_default_strategy_is_left_untouched(self):
        default = tf.distribute.get_strategy()
        before = dict(vars(default))
        strategy = strategies.get("default")
        self.assertIs(strategy, default)
        self.assertEqual(dict(vars(tf.distribute.get_strategy())), before)
        self.assertFalse(hasattr(default, "tfpar"))
        self.assertEqual(strategies.selection(strategy).name, "default")

    def test_a_foreign_strategy_of_several_replicas_trains_as_keras_alone(self):
        # Until 0.4.0 the registry installed tfpar's fixes of Keras for a strategy not derived
        # from TfparStrategy; such a class gets them by deriving from it.
        strategies.register("mine", lambda devices: tf.distribute.MirroredStrategy(
            devices.tf_names))
        keras_fixes.uninstall()
        self.addCleanup(strategies.get, "mirrored", 2)  # A TfparStrategy installs them again.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy = strategies.get("mine", 2)
        self.assertFalse(keras_fixes.installed())
        self.assertEqual(strategies.selection(strategy).name, "mine")

    def test_duplicate_name_raises_unless_override(self):
        strategies.register("mine", lambda devices: tf.distribute.get_strategy())
        with self.assertRaisesRegex(RegistryError, r"'mine' is already registered; pass "
                                                   r"override=True"):
            strategies.register("mine", lambda devices: tf.distribute.get_strategy())
        strategies.register("mine", lambda devices: tf.distribute.OneDeviceStrategy("/cpu:0"),
                            override=True)
        self.assertIsInstance(strategies.get("mine"), tf.distribute.OneDeviceStrategy)

    def test_factory_returning_none_is_an_error(self):
        strategies.register("mine", lambda devices: None)
        with self.assertRaisesRegex(TypeError, r"returned None, not a tf\.distribute\.Strategy"):
            strategies.get("mine")

    def test_invalid_name(self):
        with self.assertRaisesRegex(RegistryError, r"Received: name='my strategy'"):
            strategies.register("my strategy", lambda devices: None)

    def test_entry_point_plugins_are_found(self):
        def plugin_strategy(devices):
            """A plugin's strategy."""
            return tf.distribute.OneDeviceStrategy(devices.tf_names[0])

        point = mock.Mock(spec=metadata.EntryPoint)
        point.name = "plugin_strategy"
        point.load.return_value = plugin_strategy
        with mock.patch.object(registry.metadata, "entry_points", return_value=[point]) as eps, \
                mock.patch.object(registry, "_entry_points_loaded", False):
            self.assertEqual(strategies.available()["plugin_strategy"], "A plugin's strategy.")
            eps.assert_called_once_with(group="tfpar.strategies")
        self.assertIsInstance(strategies.get("plugin_strategy"), tf.distribute.OneDeviceStrategy)


if __name__ == "__main__":
    tf.test.main()
