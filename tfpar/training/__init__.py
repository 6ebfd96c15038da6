"""Training runs: one configuration trained on each of several device sets.

- :mod:`.config`: :class:`TrainConfig`, checked on construction (no TensorFlow);
- :mod:`.building`: the model built and compiled under a strategy (also the benchmark's);
- :mod:`.run`: :func:`train_on_devices` and :func:`train_each`, returning :class:`RunResult`.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__, {
    "TrainConfig": "config", "DTYPES": "config", "OPTIMIZERS": "config",
    "build_compiled_model": "building", "check_compile_options": "building",
    "replica_devices": "building",
    "RunResult": "run", "train_on_devices": "run", "train_each": "run",
    "Recommendation": "recommendations", "recommend": "recommendations",
})
