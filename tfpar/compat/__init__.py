"""Every version-gated workaround of Keras or TensorFlow, and the gate they share.

tfpar uses public Keras and TensorFlow APIs everywhere else. What no public API serves lives
here, each piece with why, the upstream issue where there is one, the versions it was verified
against (:mod:`.versions`) and a test that fails without it:

- :mod:`.versions`: ``(major, minor)`` parsing and the verified Keras range with its switch.
- :mod:`.keras_internals`: the optimizer and model state the exact all-reduce step reads and
  updates (iteration counter, gradient accumulators, EMA averages, weight-decay exclusions,
  the logged loss).

:mod:`tfpar.keras_fixes` (wrappers of two ``fit`` internals) and
:mod:`tfpar.strategies.iterator_release` (freeing ``tf.data`` iterators off the training
thread) gate themselves with :mod:`.versions`.
"""
