"""A user's multi-worker script with its own kill-and-resume, run by the launcher's tests.

``python user_resume_worker.py MODEL_DIR CRASH_MARKER OUTPUT``: trains 4 epochs under
``multi_worker_allreduce`` with :class:`tfpar.callbacks.EpochCheckpoint` (resuming from
MODEL_DIR), every worker crashing at the start of epoch 3 unless CRASH_MARKER exists (worker 1
creates it, so a restarted job does not crash again), and saves the final weights to OUTPUT.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar.callbacks import EpochCheckpoint


class CrashOnce(keras.callbacks.Callback):
    def __init__(self, marker: str, rank: int):
        super().__init__()
        self.marker, self.rank = marker, rank

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2 and not os.path.exists(self.marker):
            if self.rank == 1:
                open(self.marker, "w").close()
            os._exit(3)  # The process dies, as in a crash.


def main(model_dir: str, marker: str, output: str) -> None:
    strategy = tfpar.strategies.get("multi_worker_allreduce", 1)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 3, 64)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    checkpoint = EpochCheckpoint(model_dir, model, strategy)
    initial_epoch = checkpoint.restore()
    print(f"starting at epoch {initial_epoch}", flush=True)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=4,
              epochs=4, initial_epoch=initial_epoch, verbose=0,
              callbacks=[checkpoint, CrashOnce(marker, rank)])
    if rank == 0:
        np.savez(output, *model.get_weights())


if __name__ == "__main__":
    main(*sys.argv[1:])
