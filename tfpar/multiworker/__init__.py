"""Training across worker processes.

- :mod:`.cluster`: where the workers are (TF_CONFIG, SLURM, explicit hosts), checked; waiting
  for the peers; connecting;
- :mod:`.failures`: what a failed collective means (which peer stopped answering);
- :mod:`.launcher`: runs a job's workers on this machine (``tfpar-launch``);
- :mod:`.private_network`: the private loopback network the launcher's workers run in.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__)
