"""scripts/train.py, except that one worker kills itself right after saving an epoch.

Usage (through the launcher): train_and_die.py RANK EPOCH -- TRAIN.PY FLAGS...: the worker of
that rank is killed (SIGKILL, as by the out-of-memory killer) once its EpochCheckpoint has
saved that epoch (1-based), so a test needs no timing to kill a job mid-training.
"""

import json
import os
import runpy
import signal
import sys

from tfpar.callbacks import checkpointing


def main() -> None:
    rank, epoch = int(sys.argv[1]), int(sys.argv[2])
    script, *flags = sys.argv[sys.argv.index("--") + 1:]
    save = checkpointing.EpochCheckpoint.on_epoch_end

    def save_then_die(self, finished, logs=None):
        save(self, finished, logs)
        if (finished + 1 == epoch
                and json.loads(os.environ["TF_CONFIG"])["task"]["index"] == rank):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpointing.EpochCheckpoint.on_epoch_end = save_then_die
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
