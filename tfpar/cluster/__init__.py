"""Training across worker processes: the cluster, its peers, and running its workers.

- :mod:`.spec`: where the workers are (TF_CONFIG, SLURM, a Kubernetes Indexed Job, explicit
  hosts), checked; what this process is in the cluster;
- :mod:`.peers`: waiting for the peers, connecting the strategy to them, leaving last;
- :mod:`.failures`: what a failed collective means (which peer stopped answering);
- :mod:`.launcher`: runs a job's workers on this machine (``tfpar-launch``);
- :mod:`.elastic`: an elastic job's worker slots (which run, which were lost);
- :mod:`.worker_environment`: the environment of the workers tfpar starts (Keras 3);
- :mod:`.private_network`: the private loopback network the launcher's workers run in;
- :mod:`.slurm`, :mod:`.kubernetes`: the cluster as those schedulers describe it.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__)
