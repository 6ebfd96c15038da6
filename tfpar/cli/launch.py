"""``tfpar-launch``: run a command as N local workers, e.g. multi-worker training.

Example::

    tfpar-launch --num_workers=2 -- \\
        tfpar-train --strategy=multi_worker --dataset=digits

    # Elastic: 4 workers, going on with 3 or 2 when one keeps failing.
    tfpar-launch --num_workers=2:4 --max_restarts=1 -- \\
        tfpar-train --strategy=multi_worker_allreduce --model_dir=/tmp/job
"""

from __future__ import annotations

import sys

from absl import flags

from tfpar.cli import common
from tfpar.cluster import elastic
from tfpar.cluster import launcher
from tfpar.errors import ConfigError

FLAGS = flags.FLAGS

flags.DEFINE_string("num_workers", "2",
                    "Number of worker processes: N, or MIN:MAX for an elastic job (as torchrun's "
                    "--nnodes), which goes on with fewer workers, down to MIN, when one keeps "
                    "failing (more than --max_restarts times at a number of workers), from the "
                    "last state saved in the folder the job's chief declares (tfpar-train's "
                    "--model_dir) at the same global batch, and "
                    "tries the lost ones again at the next restart or epoch boundary.")
flags.DEFINE_enum("network", "private", list(launcher.NETWORKS),
                  "private: the workers run on a loopback network of their own, which nothing "
                  "outside the job can reach (and they cannot reach the network: download "
                  "datasets first; Linux only). host: on this machine's network, where "
                  "TensorFlow's servers listen on every interface with no authentication "
                  "(firewall their ports).")
flags.DEFINE_string("host", "127.0.0.1",
                    "The workers' address (must be loopback with --network=private).")
flags.DEFINE_integer("max_restarts", 0,
                     "After a worker fails (a crash, a kill, a lost peer), stop the others and "
                     "start the whole job again with new ports, up to this many times; each "
                     "restart resumes from the last state saved in the folder the job's chief "
                     "declares (tfpar-train's --model_dir, which it then requires; Keras's "
                     "BackupAndRestore and tfpar's EpochCheckpoint declare theirs), else it "
                     "starts from scratch and says so.")
flags.DEFINE_bool("resumes_itself", False,
                  "The command resumes by itself when started again from a state whose folder "
                  "it does not declare (your script with a saver of its own): a restart's line "
                  "says so instead of 'from scratch'.")
flags.DEFINE_integer("gpus_per_worker", None,
                     "GPUs each worker gets of this host's (CUDA_VISIBLE_DEVICES, else those "
                     "nvidia-smi lists, else, where it is missing or fails, those the driver lists "
                     "in /proc/driver/nvidia/gpus), through its CUDA_VISIBLE_DEVICES: by default "
                     "the host's GPUs divided evenly among the workers; 0 runs them on the CPU. "
                     "On a host without GPUs nothing is given.")
flags.DEFINE_bool("all_output", False,
                  "Every worker prints its progress bars and report; by default only the chief "
                  "(worker 0) does, the others print warnings and errors.")


def main(argv: list[str]) -> None:
    """Launches ``argv[1:]`` (the command after ``--``) as the workers; exits with their
    status."""
    if len(argv) < 2:
        raise ConfigError("Give the command to run after '--', e.g. -- tfpar-train "
                          "--strategy=multi_worker.")
    fewest, most = elastic.parse_worker_range(FLAGS.num_workers)
    sys.exit(launcher.launch(argv[1:], most, FLAGS.host,
                             all_output=FLAGS.all_output, network=FLAGS.network,
                             max_restarts=FLAGS.max_restarts,
                             resumes_itself=FLAGS.resumes_itself, min_workers=fewest,
                             gpus_per_worker=FLAGS.gpus_per_worker))


def run() -> None:
    """Console-script entry point."""
    common.run_main(main, __name__, positional=True)  # The command after '--'.


if __name__ == "__main__":
    run()
