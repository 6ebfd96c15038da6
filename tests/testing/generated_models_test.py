"""Every kind of model under every in-process entry: generated cases (Hypothesis, a fixed
seed), each held to its entry's promise against one device, or refused in one line.

The README suite runs :data:`README_EXAMPLES` cases (in two tests, each over half of
:data:`RUNS`, which the suite's two processes take at once); the cluster stage
(``-m cluster``) :data:`CLUSTER_EXAMPLES` more. How many cases each entry got, and with which
outcome, is reported in the test summary ("generated models" lines). A counterexample becomes a
named test in ``tests/allreduce/`` or here.
"""

import collections
import unittest
import zlib

import keras
import pytest
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import assume
from hypothesis import example
from hypothesis import given
from hypothesis import settings

from tfpar import testing
from tfpar.errors import ConfigError
from tfpar.strategies import refusals
from tfpar.testing import generated_models

README_EXAMPLES = 30
CLUSTER_EXAMPLES = 60
ENTRIES = ("default", "one_device", "mirrored", "central_storage", "allreduce")
"""The in-process entries (the multi-worker ones run the same steps across processes)."""


RUNS = (("default", 1, 0), ("one_device", 1, 0), ("mirrored", 2, 0), ("mirrored", 4, 0),
        ("central_storage", 2, 0), ("allreduce", 2, 0), ("allreduce", 4, 0),
        ("allreduce", 2, 2), ("allreduce", 2, 4), ("allreduce", 4, 4))
"""``(entry, devices, virtual_replicas)``: every in-process entry (the multi-worker ones run the
same steps across processes), on 1, 2 and 4 devices, with and without ``virtual_replicas``."""


ONE_EXPLICIT_CASE = generated_models.ModelCase(form="own_train_step", examples=9, batch_size=8,
                                              seed=1)
"""Held to its run (``allreduce`` on 2, ``virtual_replicas=4``) before the generated cases: the
README suite's 30 derandomized cases hold one ``own_train_step`` case, under no
``virtual_replicas`` run, so a model's own step trained there unrefused went unseen (a wider
draw of 120 caught it with one case). Its last batch of 1 leaves replica 1 empty."""


def run_of(case) -> tuple[str, int, int]:
    """The run a case is held to: spread evenly over :data:`RUNS` by the case itself, so every
    run gets its share of any set of cases and a case always meets the same run."""
    return RUNS[zlib.crc32(str(case).encode()) % len(RUNS)]


def _settings(examples: int):
    # No shrinking: a case trains models for seconds, and the first counterexample is
    # printed whole (its fields name it).
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit,
                                                                       Phase.generate])


class GeneratedModelsTest(testing.StrategyTestCase):
    NUM_DEVICES = 4

    @pytest.fixture(autouse=True)
    def _report(self, record_property):
        self.outcomes = collections.Counter()
        yield
        for (run, outcome), count in sorted(self.outcomes.items()):
            record_property("generated models", f"{run}: {count} {outcome}")

    def tearDown(self):
        keras.config.set_dtype_policy("float32")
        super().tearDown()

    def explore(self, examples: int, runs: tuple = RUNS) -> None:
        """Holds ``examples`` generated cases whose run is among ``runs`` to their runs'
        promises; fails with every counterexample (not only the first), each one line."""
        failures = []

        @_settings(examples)
        @given(case=testing.model_cases())
        def check(case):
            run = run_of(case)
            assume(run in runs)
            entry, num_devices, virtual = run
            name = f"{entry} on {num_devices}" + (f", virtual_replicas={virtual}"
                                                  if virtual else "")
            try:
                outcome = self.assertKeepsPromise(case, entry, num_devices,
                                                  virtual_replicas=virtual)
            except Exception as e:  # noqa: BLE001 - every counterexample is reported.
                outcome = "counterexample"
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                failures.append(f"{case} under {name}: {type(e).__name__}: {first}")
            finally:
                keras.config.set_dtype_policy("float32")
            self.outcomes[(name, outcome)] += 1

        # Added here, not as a decorator of check: check's source seeds the derandomized draws.
        if run_of(ONE_EXPLICIT_CASE) in runs:
            check = example(case=ONE_EXPLICIT_CASE)(check)
        check()
        self.assertEqual(failures, [], f"{len(failures)} counterexamples")

    def test_every_entry_keeps_its_promise(self):
        self.explore(README_EXAMPLES // 2, RUNS[:len(RUNS) // 2])

    def test_every_entry_keeps_its_promise_with_allreduce(self):
        self.explore(README_EXAMPLES - README_EXAMPLES // 2, RUNS[len(RUNS) // 2:])

    def test_keras_step_keeps_its_promise(self):
        # Keras's step under mirrored, which the drawn cases may leave out: a sum loss with
        # sample weights on 2 devices (uneven: in sync), and an LSTM on 4 (even: one device).
        sums = generated_models.ModelCase(layers=("dense", "dropout"), loss="sum",
                                          weights="sample", examples=17, batch_size=8)
        self.assertEqual(self.assertKeepsPromise(sums, "mirrored", 2), "in_sync")
        recurrent = generated_models.ModelCase(inputs="tokens", layers=("lstm", "layer_norm"),
                                               examples=16, batch_size=8)
        self.assertEqual(self.assertKeepsPromise(recurrent, "mirrored", 4), "matches_one_device")

    @pytest.mark.cluster
    def test_every_entry_keeps_its_promise_wider(self):
        self.explore(CLUSTER_EXAMPLES)


class ModelCaseTest(testing.StrategyTestCase):
    """The cases themselves: what they build, and the promises they name."""

    NUM_DEVICES = 4

    def test_every_form_builds_and_trains(self):
        for form in generated_models.FORMS:
            case = generated_models.ModelCase(inputs="tokens", layers=("gru", "dropout"),
                                              form=form, weights="class", examples=5,
                                              batch_size=2)
            model = case.build()
            losses = case.train(model, case.dataset())
            self.assertLen(losses, 3, form)

    def test_bad_fields_are_refused_in_one_line(self):
        with self.assertRaisesRegex(ConfigError, r"layers for 'vector' inputs must be among .*"
                                                 r"Received: conv\."):
            generated_models.ModelCase(layers=("conv",))
        with self.assertRaisesRegex(ConfigError, r"loss must be one of mean, sum, custom\. "
                                                 r"Received: loss='median'"):
            generated_models.ModelCase(loss="median")

    def test_promises(self):
        plain = generated_models.ModelCase(examples=17, batch_size=8)
        self.assertEqual(plain.batches(), [8, 8, 1])
        self.assertEqual(plain.expected_promise("allreduce", 2), "matches_one_device")
        self.assertEqual(plain.expected_promise("mirrored", 2), "in_sync")  # A last batch of 1.
        self.assertEqual(plain.expected_promise("allreduce", 2, 4), "same_on_any_world_size")
        dropout = generated_models.ModelCase(layers=("dropout",))
        self.assertEqual(dropout.expected_promise("allreduce", 2), "in_sync")
        self.assertEqual(dropout.expected_promise("allreduce", 1), "matches_one_device")

    def test_a_users_own_layer(self):
        case = generated_models.ModelCase(layers=("scale",), extra_layers={
            "scale": lambda: keras.layers.Rescaling(2.0)})
        self.assertEqual(self.assertKeepsPromise(case, "allreduce", 2), "matches_one_device")

    def test_the_oracle_sees_a_wrong_update(self):
        # An entry that is not what it says fails the oracle: a loss multiplied by the replica
        # count (as the step once weighed sum losses) is 2x on 2 devices.
        case = generated_models.ModelCase(loss="sum", examples=16, batch_size=8)
        original = generated_models.ModelCase._loss

        def times_replicas(self):
            loss = original(self)

            def scaled(y_true, y_pred):
                replicas = tf.distribute.get_strategy().num_replicas_in_sync
                return loss(y_true, y_pred) * float(replicas)

            return scaled

        generated_models.ModelCase._loss = times_replicas
        self.addCleanup(setattr, generated_models.ModelCase, "_loss", original)
        with self.assertRaisesRegex(AssertionError, "differ from 1 device"):
            self.assertKeepsPromise(case, "allreduce", 2, virtual_replicas=2)

    def test_keras_step_on_an_empty_replica_with_a_convolution_is_refused(self):
        # A convolution on a replica without examples (a last batch of 3 on 4 devices) fails
        # inside oneDNN's kernel, or, without oneDNN, a depthwise one trains on garbage.
        case = generated_models.ModelCase(inputs="image", examples=3, batch_size=3)
        strategy = self.strategy("mirrored", 4)
        with strategy.scope():
            model = case.build()
        with self.assertRaises(ConfigError) as refused:
            case.train(model, case.dataset())
        self.assertEqual(str(refused.exception), refusals.KERAS_STEP_EMPTY_REPLICA)

    def test_keras_step_on_an_empty_replica_with_batchnorm_is_refused(self):
        # The empty replicas' moving statistics would become NaN.
        case = generated_models.ModelCase(layers=("batch_norm",), examples=1, batch_size=1)
        self.assertEqual(self.assertKeepsPromise(case, "mirrored", 4), "refused")

    @unittest.expectedFailure
    def test_own_train_step_with_a_sum_loss_logs_the_loss_one_device_logs(self):
        # It logs twice the loss on 2 replicas (6.83 against 3.42); the weights are one
        # device's. Where the factor comes from (Keras's scaling of a sum loss, or tfpar's
        # marks of scaled losses) is not yet found.
        case = generated_models.ModelCase(form="own_train_step", loss="sum", examples=6,
                                          batch_size=6, seed=1)
        self.assertMatchesSingleDevice(case.build, case.dataset(),
                                       self.strategy("allreduce", 2), train=case.train,
                                       reference_train=case.train)

    def test_tfpars_step_on_an_empty_shard_with_both(self):
        case = generated_models.ModelCase(inputs="image", layers=("batch_norm",), examples=3,
                                          batch_size=3)
        self.assertEqual(self.assertKeepsPromise(case, "allreduce", 4), "in_sync")

    def test_a_refusal_is_an_outcome(self):
        case = generated_models.ModelCase(form="own_train_step")
        self.assertEqual(self.assertKeepsPromise(case, "allreduce", 2, virtual_replicas=2),
                         "refused")


if __name__ == "__main__":
    tf.test.main()
