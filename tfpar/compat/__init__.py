"""Every version-gated workaround of Keras or TensorFlow, and the gate they share.

tfpar uses public Keras and TensorFlow APIs everywhere else. What no public API serves lives
here, each piece with why, the upstream issue where there is one, the versions it was verified
against (:mod:`.versions`) and a test that fails without it:

- :mod:`.versions`: ``(major, minor)`` parsing and the verified Keras range with its switch.
- :mod:`.keras_internals`: the optimizer and model state the exact all-reduce step reads and
  updates (iteration counter, gradient accumulators, EMA averages, weight-decay exclusions,
  the logged loss).

- :mod:`.keras_fixes`: one module per Keras defect under ``tf.distribute`` (wrappers of
  Keras's ``fit`` internals, of how its variables add under ``central_storage``, of
  ``BackupAndRestore``), installed by every tfpar strategy of several replicas
  (:class:`tfpar.strategies.base.TfparStrategy`);
- :mod:`.iterator_release`: ``tf.data`` iterators freed off the training thread (by that base
  class, for every strategy class of tfpar's);
- :mod:`.coordination`: the coordination service's heartbeat timeout (``heartbeat_timeout``);
- :mod:`.collective_keys`: collective instance keys taken when a function is traced, for
  Keras's multi-step loop across workers (used by :mod:`.keras_fixes`);
- :mod:`.mid_epoch_resume`: ``fit`` starting a resumed epoch at the step its state was saved
  at (installed with :mod:`.keras_fixes`);
- :mod:`.multi_worker_cpus`: a multi-worker strategy's replicas on a worker's logical CPU
  devices (TensorFlow's takes one CPU device per worker);
- :mod:`.keras_distribution`: where ``keras.distribution`` on the TensorFlow backend is hooked
  (``set_distribution``, the backend's missing functions), for :mod:`tfpar.keras_distribution`;
- :mod:`.coordination_values`: keys the workers of a job share through the coordination
  service (the step every worker stops at after a preemption notice).

This package is the bottom layer of tfpar above :mod:`tfpar.errors`: it imports nothing else
of tfpar.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__)
