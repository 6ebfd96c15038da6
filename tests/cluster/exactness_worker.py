"""One worker of a 2-worker job of the exactness matrix, run under the launcher.

``python exactness_worker.py ENTRY MODEL RESUME STATE OUTPUT [INTERRUPT]``: trains MODEL (one of
``tests/end_to_end/exactness_test.py``'s) under ENTRY, one replica per worker, resuming from
STATE with RESUME: ``notice`` (:class:`~tfpar.callbacks.EpochCheckpoint` and
:class:`~tfpar.callbacks.SaveOnPreemption`), ``elastic`` (the same; the worker in slot 2 kills
itself once the optimizer made 8 steps, and an elastic launcher goes on without it) or
``backup_and_restore_kill`` (Keras's ``BackupAndRestore(save_freq=3)``). With INTERRUPT,
worker 1 sends itself SIGTERM after epoch 2's second step (``notice``), or SIGKILL once the
optimizer made 8 steps (``backup_and_restore_kill``; the launcher restarts the job, and the
restarted worker finds ``STATE.killed`` and goes on).
Every worker writes each variable of its model and optimizer (its own replica's copy) to
``OUTPUT.RANK.npz``.
"""

import json
import os
import signal
import sys

import keras
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "end_to_end"))

import exactness_test  # noqa: E402  (after the path it lives on)

import tfpar  # noqa: E402
from tfpar.callbacks import AverageAtEpochEnd  # noqa: E402
from tfpar.callbacks import EpochCheckpoint  # noqa: E402
from tfpar.callbacks import SaveOnPreemption  # noqa: E402


class KillOnce(keras.callbacks.Callback):
    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 8 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main(entry: str, model_name: str, resume: str, state: str, output: str,
         interrupt: str = "") -> None:
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    keras.utils.set_random_seed(1)
    strategy = tfpar.strategies.get(entry, 1)
    with strategy.scope():
        model = exactness_test.MODELS[model_name]()
    x, y = exactness_test.examples()
    callbacks: list = [AverageAtEpochEnd(strategy)]
    initial_epoch = 0
    if resume in ("notice", "elastic"):
        checkpoint = EpochCheckpoint(state, model, strategy)
        initial_epoch = checkpoint.restore()
        callbacks += [checkpoint, SaveOnPreemption(checkpoint)]
        if interrupt and resume == "notice" and rank == 1:
            callbacks.append(exactness_test.SignalAt(2, 2))
        if interrupt and resume == "elastic" and os.environ["TFPAR_WORKER_SLOT"] == "2":
            callbacks.append(KillOnce(f"{state}.killed"))  # Inside epoch 2: lost for good.
    else:
        callbacks.append(keras.callbacks.BackupAndRestore(state, save_freq=3,
                                                          delete_checkpoint=False))
        if interrupt and rank == 1:
            callbacks.append(KillOnce(f"{state}.killed"))
    model.fit(x, y, batch_size=exactness_test.BATCH, epochs=exactness_test.EPOCHS,
              shuffle=False, verbose=0, initial_epoch=initial_epoch, callbacks=callbacks)
    values = {f"{place:03d} {path}": value
              for (place, _), (path, value) in exactness_test.state(model).items()}
    np.savez(f"{output}.{rank}.npz", **values)


if __name__ == "__main__":
    main(*sys.argv[1:])
