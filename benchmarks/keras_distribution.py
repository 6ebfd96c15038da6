"""What training through ``keras.distribution.DataParallel`` costs against the same tfpar entry
chosen with ``tfpar.strategies.get``: paired, interleaved rounds on the same devices.

Both models are LeNet with SGD, built once each, on the same random images; each round times one
``fit`` of a fixed number of steps of each, in turn (the first call of each traces and is not
timed). The ratio per round is the entry's time over ``DataParallel``'s (above 1: ``DataParallel``
is faster); the median and the range of the rounds are printed, with the CPU and the versions.

Usage (from a checkout with tfpar installed; about a minute on 2 cores)::

    python benchmarks/keras_distribution.py [--devices=2] [--entry=allreduce] [--batch=256]
        [--steps=60] [--rounds=5] [--out=benchmarks/results/NAME.json]

``--out`` keeps the run as a results file (:mod:`results_file`): the command, the CPU, the
versions, the date and every round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_file  # noqa: E402 - beside this script.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--entry", default="allreduce")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import tfpar
    from tfpar import devices
    from tfpar.host import machine

    devices.ensure_logical_cpus(args.devices)
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.random((args.batch * args.steps, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * args.steps)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache()

    def build() -> keras.Model:
        model = tfpar.models.lenet()
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    tfpar.keras_distribution.install(args.entry)
    names = keras.distribution.list_devices()[:args.devices]
    with keras.distribution.DataParallel(devices=names).scope():
        through_keras = build()
    with tfpar.strategies.get(args.entry, args.devices).scope():
        through_entry = build()
    for model in (through_keras, through_entry):
        model.fit(data, epochs=1, verbose=0)  # Traced here, not in a round.

    def seconds(model: keras.Model) -> float:
        start = time.perf_counter()
        model.fit(data, epochs=1, verbose=0)
        return time.perf_counter() - start

    ratios, rounds = [], []
    for round_index in range(args.rounds):
        keras_time, entry_time = seconds(through_keras), seconds(through_entry)
        ratios.append(entry_time / keras_time)
        rounds.append({"keras_distribution_seconds": keras_time, "entry_seconds": entry_time})
        print(f"round {round_index + 1}: keras.distribution {keras_time:.2f} s, "
              f"{args.entry} {entry_time:.2f} s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"{machine.describe_cpu()}; TensorFlow {tf.__version__}, Keras {keras.version()}; "
          f"LeNet, global batch {args.batch}, {args.steps} steps per fit, {args.devices} "
          f"devices, entry {args.entry}")
    print(f"speed of keras.distribution.DataParallel relative to the entry: median "
          f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        results_file.write(args.out, rounds, median_ratio=statistics.median(ratios))

if __name__ == "__main__":
    main()
