"""scripts/train.py, except that one worker sends itself a signal at a chosen point of training.

Usage (alone, or through the launcher): ``train_and_signal.py RANK WHEN EPOCH STEP SIGNAL --
TRAIN.PY FLAGS...``: the process of that rank (0 alone) sends itself SIGNAL (``SIGTERM``,
``SIGUSR1``, ...), so a test needs no timing to preempt a job mid-training. WHEN is:

- ``step``: right after step STEP (1-based) of epoch EPOCH (1-based) ended (STEP 0: as the
  epoch begins, so the notice arrives during its first step);
- ``twice``: the same, and again one step later;
- ``validation``: while the test accuracy of epoch EPOCH is evaluated (STEP is ignored);
- ``saving``: as the state of epoch EPOCH starts to be saved (STEP is ignored);
- ``slow_save``: right after step 1 of epoch EPOCH, and every save from then on takes STEP
  seconds (past the grace budget, the process ends with the last complete state intact).
"""

import json
import os
import runpy
import signal
import sys
import time

from tfpar.callbacks import checkpointing
from tfpar.callbacks import save_on_preemption as preemption
from tfpar.training import evaluation


def main() -> None:
    rank, when, epoch, step, name = sys.argv[1:6]
    epoch, step, signum = int(epoch), int(step), signal.Signals[name]
    script, *flags = sys.argv[sys.argv.index("--") + 1:]
    config = os.environ.get("TF_CONFIG")
    if (json.loads(config)["task"]["index"] if config else 0) != int(rank):
        when = "never"
    state = {"epoch": 0, "sent": 0}

    def send() -> None:
        state["sent"] += 1
        os.kill(os.getpid(), signum)

    begin, batch_end = (preemption.SaveOnPreemption.on_epoch_begin,
                        preemption.SaveOnPreemption.on_train_batch_end)

    def on_epoch_begin(self, e, logs=None):
        state["epoch"] = e + 1
        if when == "step" and step == 0 and state["epoch"] == epoch and not state["sent"]:
            send()
        return begin(self, e, logs)

    def on_train_batch_end(self, batch, logs=None):
        at = 1 if when == "slow_save" else step
        if when in ("step", "twice", "slow_save") and state["epoch"] == epoch:
            if (batch + 1 == at and not state["sent"]) or (
                    when == "twice" and batch == step and state["sent"] == 1):
                send()
        return batch_end(self, batch, logs)

    preemption.SaveOnPreemption.on_epoch_begin = on_epoch_begin
    preemption.SaveOnPreemption.on_train_batch_end = on_train_batch_end

    test_batch_end = evaluation.TestAccuracy.on_epoch_end

    def on_test(self, e, logs=None):  # The test accuracy's evaluation, at the epoch's end.
        if when == "validation" and e + 1 == epoch and not state["sent"]:
            send()
        return test_batch_end(self, e, logs)

    evaluation.TestAccuracy.on_epoch_end = on_test
    snapshot = checkpointing.EpochCheckpoint._snapshot

    def snapshotting(self, epochs, steps, saving):  # A save's start, before it writes.
        if when == "saving" and epochs == epoch and not steps and not state["sent"]:
            send()
        if when == "slow_save" and state["sent"]:
            time.sleep(step)
        return snapshot(self, epochs, steps, saving)

    checkpointing.EpochCheckpoint._snapshot = snapshotting
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
