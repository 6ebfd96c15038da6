"""Tests of TrainConfig's strategy field: one value, and the deprecated ways still working."""

import dataclasses

import tensorflow as tf

from tfpar import strategies
from tfpar.errors import ConfigError
from tfpar.training.config import TrainConfig


class StrategyFieldTest(tf.test.TestCase):

    def test_a_name_is_its_entry_with_the_default_options(self):
        config = TrainConfig(strategy="allreduce")
        self.assertEqual(config.strategy, strategies.choose("allreduce"))
        self.assertEqual(TrainConfig().strategy.name, "mirrored")
        self.assertEqual(config.strategy_options, {})

    def test_a_copy_keeps_the_strategy_and_its_options(self):
        choice = strategies.choose("allreduce", accumulation_steps=4)
        config = dataclasses.replace(TrainConfig(strategy=choice), epochs=3, lr=0.1)
        self.assertEqual(config.strategy, choice)
        self.assertEqual(config.for_devices(2), (4 * 64, 0.1))
        self.assertEqual(config.to_dict()["strategy"], "allreduce")
        self.assertEqual(config.to_dict()["strategy_options"]["accumulation_steps"], 4)

    def test_strategy_options_and_choice_warn_and_still_work(self):
        with self.assertWarnsRegex(DeprecationWarning,
                                   r"strategy_options is deprecated .* 0\.4\.0: pass "
                                   r"strategy=tfpar\.strategies\.choose\(name, \*\*options\)"):
            config = TrainConfig(strategy="allreduce",
                                 strategy_options={"accumulation_steps": 2})
        self.assertEqual(config.strategy.micro_batches, 2)

    def test_comparing_the_strategy_with_a_name_warns_and_still_matches(self):
        with self.assertWarnsRegex(DeprecationWarning, r"compare its \.name"):
            self.assertTrue(TrainConfig(strategy="allreduce").strategy == "allreduce")

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
