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

from tfpar.testing.case import StrategyTestCase
from tfpar.testing.case import ensure_devices
from tfpar.testing.case import for_each_strategy
from tfpar.testing.datasets import tiny_dataset
from tfpar.testing.reference_runs import fit_steps
from tfpar.testing.tiny_model import tiny_model

__all__ = ["StrategyTestCase", "ensure_devices", "for_each_strategy", "fit_steps", "tiny_dataset",
           "tiny_model"]

from tfpar import lazy_exports  # noqa: E402

lazy_exports.install(__name__)
