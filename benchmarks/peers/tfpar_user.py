"""tfpar as a user calls it (a registry strategy and ``model.fit``), or plain Keras.

usage: python tfpar_user.py STRATEGY NUM_DEVICES lenet|resnet18 GLOBAL_BATCH STEPS

STRATEGY is a registry entry (``mirrored``, ``allreduce``; ``multi_worker*`` under
``scripts/launch.py``, the cluster from its ``TF_CONFIG``) or ``keras`` (no strategy, default
threads). Prints ``img/s X``: the steady state of one ``fit`` of STEPS steps after warm-up,
from the end of its first step to the end of its last. ``DTYPE=bfloat16``: Keras's
``mixed_bfloat16`` policy; ``DTYPE=auto``: the policy ``tfpar.training.recommend`` returns for
this machine. ``START_ON_LINE=1``: after warm-up, print ``warm`` and start the timed ``fit``
on a line from stdin (how ``independent.py`` starts its processes together).
``STEPS_PER_EXECUTION=k``: ``compile(steps_per_execution=k)``; ``auto``: what
``recommend`` returns (a strategy's run only; plain Keras takes 1). Choices go to stderr.
"""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfpar


class Clock(keras.callbacks.Callback):
    """The time each compiled call of training steps ended, and its last step's index."""

    def __init__(self):
        super().__init__()
        self.ends: list[tuple[int, float]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((batch, time.perf_counter()))


def main(name: str, devices: int, model_name: str, batch: int, steps: int) -> None:
    dtype = os.environ.get("DTYPE", "float32")
    if dtype == "bfloat16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    if name == "keras":
        strategy = tf.distribute.get_strategy()
    elif name.startswith("multi_worker"):
        strategy = tfpar.strategies.get(name)
    else:
        strategy = tfpar.strategies.get(name, devices=devices)
    per_call = os.environ.get("STEPS_PER_EXECUTION", "1")
    compile_arguments = {"steps_per_execution": 1 if per_call == "auto" else int(per_call)}
    if "auto" in (dtype, per_call) and name != "keras":
        workers = tfpar.cluster.spec.tasks_on_this_host(getattr(strategy, "cluster_resolver",
                                                                None))
        advice = tfpar.training.recommend(devices if workers == 1 else 1, workers=workers)
        if dtype == "auto":
            advice.apply_policy()
        if per_call == "auto":
            compile_arguments = advice.compile_arguments()
        print("; ".join(advice.reasons), file=sys.stderr)
    with strategy.scope():
        model = tfpar.models.resnet18() if model_name == "resnet18" else tfpar.models.lenet()
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **compile_arguments)
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    clock = Clock()
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)  # Warm-up: tracing.
    if os.environ.get("START_ON_LINE"):  # Side by side with others: start when told.
        print("warm", flush=True)
        sys.stdin.readline()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[clock])
    (first, start), (last, end) = clock.ends[0], clock.ends[-1]
    images = batch * (last - first)
    # The window on the wall clock too, so that side-by-side processes can be summed over
    # the time they all ran.
    offset = time.time() - time.perf_counter()
    print(f"img/s {images / (end - start):.2f} images {images} from {start + offset:.4f} "
          f"to {end + offset:.4f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
