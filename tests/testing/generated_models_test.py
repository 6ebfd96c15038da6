"""Every kind of model under every in-process entry: generated cases (Hypothesis, a fixed
seed), each held to its entry's promise against one device, or refused in one line.

The README suite runs :data:`README_EXAMPLES` cases; the cluster stage (``-m cluster``)
:data:`CLUSTER_EXAMPLES` more. How many cases each entry got, and with which outcome, is
reported in the test summary ("generated models" lines). A counterexample becomes a named test
in ``tests/allreduce/`` or here.
"""

import collections

import keras
import pytest
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tfpar import testing
from tfpar.errors import ConfigError
from tfpar.testing import generated_models

README_EXAMPLES = 24
CLUSTER_EXAMPLES = 120
ENTRIES = ("default", "one_device", "mirrored", "central_storage", "allreduce")
"""The in-process entries (the multi-worker ones run the same steps across processes)."""


@st.composite
def runs(draw):
    """An entry, its devices and, for the all-reduce step, ``virtual_replicas``."""
    # tfpar's own step, and its same-numbers mode, twice as often as each other entry.
    entry = draw(st.sampled_from([*ENTRIES, "allreduce"]))
    if entry in ("default", "one_device"):
        return entry, 1, 0
    virtual = draw(st.sampled_from([0, 2, 4])) if entry == "allreduce" else 0
    if virtual:
        return entry, draw(st.sampled_from([n for n in (2, 4) if virtual % n == 0])), virtual
    return entry, draw(st.sampled_from([1, 2, 4])), 0


OUTCOMES: collections.Counter = collections.Counter()


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
        OUTCOMES.clear()
        yield
        for (entry, outcome), count in sorted(OUTCOMES.items()):
            record_property("generated models", f"{entry}: {count} {outcome}")

    def tearDown(self):
        keras.config.set_dtype_policy("float32")
        super().tearDown()

    def _check(self, case, run):
        entry, num_devices, virtual = run
        outcome = self.assertKeepsPromise(case, entry, num_devices, virtual_replicas=virtual)
        OUTCOMES[(entry if not virtual else f"{entry} virtual_replicas", outcome)] += 1

    @_settings(README_EXAMPLES)
    @given(case=testing.model_cases(), run=runs())
    def test_every_entry_keeps_its_promise(self, case, run):
        self._check(case, run)

    @pytest.mark.cluster
    @_settings(CLUSTER_EXAMPLES)
    @given(case=testing.model_cases(), run=runs())
    def test_every_entry_keeps_its_promise_wider(self, case, run):
        self._check(case, run)


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

    def test_a_refusal_is_an_outcome(self):
        case = generated_models.ModelCase(form="own_train_step")
        self.assertEqual(self.assertKeepsPromise(case, "allreduce", 2, virtual_replicas=2),
                         "refused")


if __name__ == "__main__":
    tf.test.main()
