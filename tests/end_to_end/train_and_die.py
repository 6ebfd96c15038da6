"""scripts/train.py, except that one worker kills itself right after saving an epoch.

Usage (through the launcher):

- ``train_and_die.py RANK EPOCH -- TRAIN.PY FLAGS...``: the worker of that rank is killed
  (SIGKILL, as by the out-of-memory killer) once its EpochCheckpoint has saved that epoch
  (1-based), so a test needs no timing to kill a job mid-training.
- ``train_and_die.py slot SLOT EPOCH MARKER -- TRAIN.PY FLAGS...``: the worker started in the
  launcher's slot SLOT (``TFPAR_WORKER_SLOT``) is lost for good: it kills itself after saving
  EPOCH, leaving the file MARKER, and while MARKER exists a worker started in SLOT exits 1 at
  once (its machine is gone). A test removes MARKER to bring the slot's machine back.
"""

import json
import os
import runpy
import signal
import sys

from tfpar import worker_contract
from tfpar.callbacks import checkpointing


def main() -> None:
    script, *flags = sys.argv[sys.argv.index("--") + 1:]
    marker = None
    if sys.argv[1] == "slot":
        slot, epoch, marker = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        dies = int(os.environ[worker_contract.SLOT_ENV]) == slot
        if dies and os.path.exists(marker):
            print(f"slot {slot}: this machine is gone.", flush=True)
            sys.exit(1)
    else:
        rank, epoch = int(sys.argv[1]), int(sys.argv[2])
        dies = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == rank
    save = checkpointing.EpochCheckpoint.on_epoch_end

    def save_then_die(self, finished, logs=None):
        save(self, finished, logs)
        if dies and finished + 1 == epoch:
            if marker:
                with open(marker, "w", encoding="utf-8"):
                    pass
            os.kill(os.getpid(), signal.SIGKILL)

    checkpointing.EpochCheckpoint.on_epoch_end = save_then_die
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
