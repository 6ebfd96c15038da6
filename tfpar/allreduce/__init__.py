"""tfpar's hand-written data parallelism: the step's options, all-reduce algorithms, the exact step.

- :mod:`.options`: the step's options and their checks (no TensorFlow at import);
- :mod:`.algorithms`: all-reduce algorithms (collective, naive, ring) over gradient buckets;
- :mod:`.step`: the exact data-parallel training step that ``model.fit`` runs;
The strategies that make ``fit`` run it (the ``allreduce`` and ``multi_worker_allreduce``
registry entries) are in :mod:`tfpar.strategies.allreduce`.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__, {
    "ALGORITHMS": "options", "COMPRESSIONS": "options", "DEFAULT_BYTES_PER_PACK": "options",
    "StepOptions": "options",
    "all_reduce_sum": "algorithms", "without_communication": "algorithms",
    "train_step": "step",
})
