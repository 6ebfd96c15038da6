"""A user's multi-worker script with its own kill-and-resume, run by the launcher's tests.

``python user_resume_worker.py MODEL_DIR CRASH_MARKER OUTPUT [RESUME [ENTRY]]``: trains 4
epochs of 4 steps under ENTRY (default ``multi_worker_allreduce``; ``keras_distribution``:
``keras.distribution.DataParallel()`` through tfpar), resuming from MODEL_DIR
with RESUME: ``epoch_checkpoint`` (:class:`tfpar.callbacks.EpochCheckpoint`, the default),
``backup`` (Keras's ``BackupAndRestore``, ``save_freq="epoch"``), ``backup_every_2``
(``save_freq=2``) or ``backup_every_3`` (``save_freq=3``: its last save before the kill is
inside epoch 3). Unless CRASH_MARKER exists, at the start of epoch 3 every worker crashes
(``epoch_checkpoint``) or worker 1 kills itself with signal 9 (``backup*``; ``backup_every_3``
after epoch 3's second step); worker 1 creates the marker, so a restarted job does not fail
again. Saves the final weights to OUTPUT.
"""

import json
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar.callbacks import EpochCheckpoint


class CrashOnce(keras.callbacks.Callback):
    def __init__(self, marker: str, rank: int, kill: bool, after_step: int = 0):
        super().__init__()
        self.marker, self.rank, self.kill, self.after_step = marker, rank, kill, after_step
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if not self.after_step:
            self.crash()

    def on_train_batch_end(self, batch, logs=None):
        if self.after_step and batch + 1 == self.after_step:
            self.crash()

    def crash(self):
        if self.epoch == 2 and not os.path.exists(self.marker):
            if self.rank == 1:
                open(self.marker, "w").close()
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
            if not self.kill:
                os._exit(3)  # The process dies, as in a crash.


def main(model_dir: str, marker: str, output: str, resume: str = "epoch_checkpoint",
         entry: str = "multi_worker_allreduce") -> None:
    if entry == "keras_distribution":  # Keras's own API, as its guide has it.
        tfpar.keras_distribution.install()
        keras.distribution.initialize()
        distribution = keras.distribution.DataParallel()
    else:
        distribution = tfpar.strategies.get(entry, 1)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 3, 64)
    with distribution.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    strategy = model.distribute_strategy
    if resume == "epoch_checkpoint":
        checkpoint = EpochCheckpoint(model_dir, model, strategy)
        initial_epoch = checkpoint.restore()
        print(f"starting at epoch {initial_epoch}", flush=True)
        callbacks = [checkpoint]
    else:  # Keras's own, as keras.io and TensorFlow's fault-tolerance guides teach it.
        initial_epoch = 0
        callbacks = [keras.callbacks.BackupAndRestore(
            model_dir, save_freq="epoch" if resume == "backup" else int(resume[-1]))]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=4,
              epochs=4, initial_epoch=initial_epoch, verbose=0,
              callbacks=[*callbacks, CrashOnce(marker, rank, kill=resume != "epoch_checkpoint",
                                               after_step=2 if resume == "backup_every_3" else 0)])
    if rank == 0:
        np.savez(output, *model.get_weights())


if __name__ == "__main__":
    main(*sys.argv[1:])
