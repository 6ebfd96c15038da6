"""A worker for multi_worker_test: trains with fit under a multi-worker entry, saves the weights.

Usage (through the launcher):
multi_worker_worker.py multi_worker|multi_worker_allreduce INITIAL.npz OUTPUT.npz [OPTIONS_JSON
    [FIX]]: the entry's options (and "steps_per_execution" for compile,
    "gradient_accumulation_steps" for the optimizer); FIX names a
    tfpar.keras_fixes fix to remove (to show the defect it fixes). Fits, then evaluates and
    predicts on 24 examples; OUTPUT.npz.logs.json holds each step's logs, the evaluation and
    the predictions
multi_worker_worker.py serve: joins the cluster, prints "ready PID PORT", all-reduces until stopped
"""

import json
import os
import sys
import time

import keras
import numpy as np

from tfpar import strategies
from tfpar import testing
from tfpar.cluster.spec import is_chief
from tfpar.compat import keras_fixes


def main(name: str, initial_path: str, output_path: str, options: str = "{}",
         without_fix: str = "") -> None:
    options = json.loads(options)
    compile_options = {key: options.pop(key) for key in ("steps_per_execution",
                                                         "gradient_accumulation_steps")
                       if key in options}
    strategy = strategies.get(name, 1, **options)  # Before any other TF op.
    if without_fix:
        keras_fixes.uninstall((without_fix,))
    with strategy.scope():
        model = model_with_metric(**compile_options)
    model.set_weights(list(np.load(initial_path).values()))
    logs = StepLogs()
    if name == "multi_worker":
        # 3 steps of 8 over 2 workers (4 each). Keras's step weighs uneven shards inexactly,
        # so the batches divide evenly here.
        model.fit(dataset(24), verbose=0, shuffle=False, callbacks=[logs])
    else:
        # The all-reduce step is exact on uneven shards too: the last batch of 7 splits 4+3.
        model.fit(dataset(23), verbose=0, shuffle=False, callbacks=[logs])
    evaluation = model.evaluate(dataset(24), verbose=0, return_dict=True)
    predictions = model.predict(dataset(24), verbose=0)
    if is_chief(strategy):
        np.savez(output_path, *model.get_weights())
        with open(output_path + ".logs.json", "w") as f:
            json.dump({"steps": logs.steps, "evaluate": evaluation,
                       "predict": predictions.tolist()}, f)


def serve() -> None:
    strategy = strategies.get("multi_worker", 1)
    import tensorflow as tf

    config = json.loads(os.environ["TF_CONFIG"])
    port = config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1]
    print("ready", os.getpid(), port, flush=True)
    step = tf.function(lambda: strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)),
                                               axis=None))
    while True:
        step()
        time.sleep(0.05)


class StepLogs(keras.callbacks.Callback):
    """Records the logs after each training step (each compiled call of several)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append({k: float(v) for k, v in logs.items()})


def model_with_metric(steps_per_execution: int = 1,
                      gradient_accumulation_steps: int | None = None) -> keras.Model:
    """The tiny model, logging an accuracy besides its loss (two scalar logs per step)."""
    model = testing.tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(
                      0.1, gradient_accumulation_steps=gradient_accumulation_steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  steps_per_execution=steps_per_execution)
    return model


def dataset(num_examples: int):
    return testing.tiny_dataset(num_examples=num_examples, batch_size=8)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["serve"] else main(*sys.argv[1:])
