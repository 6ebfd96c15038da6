"""Training across worker processes.

- :mod:`.cluster`: where the workers are (TF_CONFIG, SLURM, explicit hosts), checked; waiting
  for the peers; connecting;
- :mod:`.strategy`: building a multi-worker strategy (the ``multi_worker*`` entries);
- :mod:`.mirrored`: the ``multi_worker`` strategy class, which refuses what Keras cannot run
  across workers (several steps per execution; the optimizer's gradient accumulation);
- :mod:`.launcher`: runs a job's workers on this machine (``tfpar-launch``);
- :mod:`.private_network`: the private loopback network the launcher's workers run in.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__)
