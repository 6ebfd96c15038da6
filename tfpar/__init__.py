"""tfpar: data-parallel training of Keras models on TensorFlow as a one-flag decision.

The package has two ways to train on several devices, as the chapters it comes from teach:

* concisely, with ``model.fit`` under a ``tf.distribute`` strategy picked by name from
  :mod:`tfpar.strategies` (``mirrored``, ``central_storage``, ``multi_worker``, ...);
* from scratch, with the hand-written data-parallel loop of :mod:`tfpar.allreduce_loop`
  (split the batch, per-replica forward/backward, all-reduce the gradients, identical update).

Modules import TensorFlow lazily where they can, so that :mod:`tfpar.devices` can still split the
CPU into logical devices before TensorFlow initialises.
"""

__version__ = "0.1.0"
