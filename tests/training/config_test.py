"""Tests of TrainConfig's strategy field: one value, a StrategyChoice."""

import dataclasses
import warnings

import tensorflow as tf

from tfpar import strategies
from tfpar.errors import ConfigError
from tfpar.training.config import TrainConfig


class StrategyFieldTest(tf.test.TestCase):

    def test_a_name_is_its_entry_with_the_default_options(self):
        config = TrainConfig(strategy="allreduce")
        self.assertEqual(config.strategy, strategies.choose("allreduce"))
        self.assertEqual(TrainConfig().strategy.name, "mirrored")

    def test_a_copy_keeps_the_strategy_and_its_options(self):
        choice = strategies.choose("allreduce", accumulation_steps=4)
        config = dataclasses.replace(TrainConfig(strategy=choice), epochs=3, lr=0.1)
        self.assertEqual(config.strategy, choice)
        self.assertEqual(config.for_devices(2), (4 * 64, 0.1))
        self.assertEqual(config.to_dict()["strategy"], "allreduce")
        self.assertEqual(config.to_dict()["strategy_options"]["accumulation_steps"], 4)

    def test_the_options_go_in_the_choice_and_a_name_is_not_the_choice(self):
        # TrainConfig's strategy_options and a choice equal to its name went in 0.4.0.
        with self.assertRaisesRegex(TypeError, r"unexpected keyword argument "
                                               r"'strategy_options'"):
            TrainConfig(strategy="allreduce", strategy_options={"accumulation_steps": 2})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            choice = TrainConfig(strategy="allreduce").strategy
            self.assertFalse(choice == "allreduce")
            self.assertEqual(choice.name, "allreduce")

    def test_something_else_is_one_clear_error(self):
        with self.assertRaisesRegex(ConfigError, r"strategy must be a registry name or a "
                                                 r"tfpar\.strategies\.StrategyChoice"):
            TrainConfig(strategy=3)


if __name__ == "__main__":
    tf.test.main()


class SaveIntervalFieldTest(tf.test.TestCase):

    def test_a_number_of_steps_as_a_flag_gives_it_or_auto(self):
        self.assertEqual(TrainConfig(save_every_steps="12").save_every_steps, 12)
        self.assertEqual(TrainConfig(save_every_steps="auto").save_every_steps, "auto")
        self.assertEqual(TrainConfig().save_budget, 0.02)
        with self.assertRaisesRegex(ConfigError, r"save_every_steps must be an integer >= 0 "):
            TrainConfig(save_every_steps="-3")
