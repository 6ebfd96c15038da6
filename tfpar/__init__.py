"""tfpar: data-parallel training of Keras models on TensorFlow as a one-flag decision.

The package has two ways to train on several devices, as the chapters it comes from teach:

* concisely, with ``model.fit`` under a ``tf.distribute`` strategy picked by name from
  :mod:`tfpar.strategies` (``mirrored``, ``central_storage``, ``multi_worker``, ...);
* from scratch, with the hand-written data-parallel step of :mod:`tfpar.allreduce`
  (split the batch, per-replica forward/backward, all-reduce the gradients, identical update),
  which ``model.fit`` runs under the ``allreduce`` entries.

Modules import TensorFlow lazily where they can, so that :mod:`tfpar.devices` can still split the
CPU into logical devices before TensorFlow initialises.
"""

__version__ = "0.4.0"

# First, in tfpar's programs only: a scheduler's notice from here on is recorded, before their
# heavy imports, and becomes the program's notice once it watches for it.
from tfpar.cluster import signal_router as _signal_router

_signal_router.record_early()

from tfpar import lazy_exports  # noqa: E402
from tfpar.host import onednn as _onednn  # noqa: E402

# TensorFlow reads whether to run its oneDNN kernels once, when it is imported: tfpar's choice
# for this CPU kind goes into the environment first (a user's setting is never changed).
_onednn.apply()

# `import tfpar; tfpar.strategies.get(...)` works without importing TensorFlow at `import
# tfpar` time (which would be too early to split the CPU into devices): every subpackage and
# module is imported when first used.
lazy_exports.install(__name__)
