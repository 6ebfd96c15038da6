"""Helpers that let users prove their distributed training in ``tf.test`` suites.

* :func:`ensure_devices`: N logical CPU devices before TensorFlow initialises (or the pytest
  option ``--tfpar-devices=N`` of the plugin this package registers).
* :class:`StrategyTestCase`: a ``tf.test.TestCase`` with :meth:`~StrategyTestCase.strategy`,
  :meth:`~StrategyTestCase.assertReplicasInSync` and
  :meth:`~StrategyTestCase.assertMatchesSingleDevice`.
* :func:`for_each_strategy`: runs a test once per registry entry and device count
  (``test_fit_mirrored_2``); combinations this machine cannot run are skipped with the reason.
* :func:`tiny_dataset` and :func:`tiny_model`: a small deterministic image dataset and a
  small compiled classifier for such checks.
* :func:`model_cases` and :class:`ModelCase`: generated models and fits (Hypothesis), each
  held to its entry's promise by :meth:`~StrategyTestCase.assertKeepsPromise`.

Example::

    import tensorflow as tf
    import tfpar.testing

    tfpar.testing.ensure_devices(2)

    class MyModelTest(tfpar.testing.StrategyTestCase):

        @tfpar.testing.for_each_strategy(num_devices=(1, 2))
        def test_fit(self, strategy_name, num_devices):
            strategy = self.strategy(strategy_name, num_devices)
            self.assertMatchesSingleDevice(my_compiled_model, tfpar.testing.tiny_dataset(),
                                           strategy)

    if __name__ == "__main__":
        tf.test.main()
"""

from tfpar import lazy_exports

__all__ = ["ModelCase", "StrategyTestCase", "ensure_devices", "for_each_strategy", "fit_steps",
           "model_cases", "tiny_dataset", "tiny_model"]

# Imported on first use: the pytest plugin in this package imports no TensorFlow.
lazy_exports.install(__name__, {
    "StrategyTestCase": "case", "ensure_devices": "case", "for_each_strategy": "case",
    "fit_steps": "reference_runs", "tiny_dataset": "datasets", "tiny_model": "models",
    "ModelCase": "generated_models", "model_cases": "generated_models"})
