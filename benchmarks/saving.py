"""What saving inside an epoch costs a training run: ``EpochCheckpoint`` saving every step,
every 10 steps, and at the interval it chooses (``auto``, 2% budget), written the way it
chooses (the default), in the background and within the step, against no saving; paired,
interleaved rounds; on one process's devices, or on worker processes under ``tfpar-launch``.

One model per mode, built alike under the same strategy; each round fits each of them one epoch
of ``--steps`` steps in turn (the first fit of each traces and is not timed). Per mode and
round: the epoch's seconds, the ratio of the no-saving epoch's seconds to it (throughput
ratio: 1.0 costs nothing), the saves made, the seconds the step was held per save (the
snapshot, and any wait for the write before), and the seconds a write took in the
background, and how many saves were written each way. For ``auto``, the interval chosen and
its line. What a kill without notice loses
(the steps since the last committed save: at most the interval, or the epoch where the interval
is an epoch or longer, plus the steps of a write still in flight) is worked out from these by
``page.py``.

Usage (from a checkout with tfpar installed; LeNet about 2 minutes on 2 cores)::

    python benchmarks/saving.py [--model=lenet] [--devices=2] [--batch=256] [--steps=60]
        [--rounds=3] [--modes=none,1,10,auto,10:sync] [--out=benchmarks/results/NAME.json]
    tfpar-launch --num_workers=2 python benchmarks/saving.py --entry=multi_worker_allreduce \
        --devices=1 [...]

A mode is ``none``, a number of steps or ``auto``, then ``:sync`` writing within the step or
``:background`` in the background (without either: the way ``EpochCheckpoint`` chooses). Under
the launcher every worker runs the rounds (each ``fit`` is the job's) and the chief reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_file  # noqa: E402 - beside this script.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lenet", choices=("lenet", "resnet18"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--entry", default="mirrored")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="none,1,10,auto,10:sync")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import tfpar
    from tfpar import devices

    devices.ensure_logical_cpus(args.devices)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar.callbacks import EpochCheckpoint
    from tfpar.cluster import spec as cluster_spec
    from tfpar.host import machine

    # Before anything starts TensorFlow's runtime (the data): a job's collectives are set
    # up as it starts.
    strategy = tfpar.strategies.get(args.entry, args.devices)
    workers = strategy.num_replicas_in_sync // args.devices
    chief = cluster_spec.is_chief(strategy)
    ways = {"": "auto", "sync": False, "background": True}
    shape = (28, 28, 1)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch * args.steps, *shape), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * args.steps)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache()
    modes = args.modes.split(",")
    runs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = tfpar.models.build(args.model, num_classes=10, input_shape=shape)
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        every, _, way = mode.partition(":")
        callbacks: list[Any] = []
        timing: dict[str, list[float]] = {"held": [], "written": [], "background": []}
        if every != "none":
            checkpoint = EpochCheckpoint(tempfile.mkdtemp(prefix="tfpar-saving-"), model,
                                         strategy, save_every_steps=every if every == "auto"
                                         else int(every), write_in_background=ways[way])
            _time_saves(checkpoint, timing)
            callbacks.append(checkpoint)
            checkpoint.restore()
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)  # Traced here.
        for values in timing.values():
            values.clear()
        runs[mode] = {"model": model, "callbacks": callbacks, "timing": timing}

    def seconds(mode: str) -> float:
        run = runs[mode]
        start = time.perf_counter()
        run["model"].fit(data, epochs=1, verbose=0, callbacks=run["callbacks"])
        return time.perf_counter() - start

    rounds = []
    for index in range(args.rounds):
        times = {mode: seconds(mode) for mode in modes}
        rounds.append({"seconds": times})
        if chief:
            print(f"round {index + 1}: " + ", ".join(f"{mode} {t:.2f} s" for mode, t in
                                                     times.items()), flush=True)
    summary = {}
    for mode in modes:
        timing, ratios = runs[mode]["timing"], [r["seconds"]["none"] / r["seconds"][mode]
                                                for r in rounds] if "none" in modes else []
        step = statistics.median(r["seconds"][mode] for r in rounds) / args.steps
        entry: dict[str, Any] = {
            "throughput_ratio": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "saves": len(timing["held"]),
            "in_background": int(sum(timing["background"])),
            "held_seconds_per_save": statistics.median(timing["held"]) if timing["held"] else 0,
            "write_seconds": statistics.median(timing["written"]) if timing["written"] else 0,
            "step_seconds": step}
        callbacks = runs[mode]["callbacks"]
        if callbacks and callbacks[0].save_every_steps == "auto":
            interval = callbacks[0].interval
            entry["interval"] = interval
            entry["interval_line"] = callbacks[0].interval_chosen
        summary[mode] = entry
    if not chief:
        return
    print(f"{machine.describe_cpu()}; TensorFlow {tf.__version__}, Keras {keras.version()}; "
          f"{args.model}, Adam, global batch {args.batch}, {args.steps} steps per epoch, "
          f"{workers} worker(s) of {args.devices} device(s), {args.entry}")
    for mode, entry in summary.items():
        ratio = entry["throughput_ratio"]
        print(f"{mode}: throughput {'' if ratio is None else f'{ratio:.3f}'} of no saving "
              f"(rounds {entry['ratio_range']}), {entry['saves']} saves, the step held "
              f"{entry['held_seconds_per_save'] * 1000:.1f} ms per save "
              f"({entry['in_background']} in the background), a write "
              f"{entry['write_seconds'] * 1000:.1f} ms"
              + (f", interval {entry['interval']}" if "interval" in entry else ""))
    if args.out:
        results_file.write(args.out, rounds, launcher=(
                               f"tfpar-launch --num_workers={workers} --" if workers > 1 else ""),
                           model=args.model, devices=args.devices, workers=workers,
                           entry=args.entry, batch=args.batch, steps=args.steps,
                           default_write="auto", summary=summary)


def _time_saves(checkpoint: Any, timing: dict[str, list[float]]) -> None:
    """Times how long each save holds the step, and each write (in the background or not)."""
    save, write = checkpoint._save_or_raise, checkpoint._write

    def held(*args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        background = save(*args, **kwargs)
        timing["held"].append(time.perf_counter() - start)
        timing["background"].append(float(background))
        return background

    def written(*args: Any, **kwargs: Any) -> str:
        start = time.perf_counter()
        path = write(*args, **kwargs)
        timing["written"].append(time.perf_counter() - start)
        return path

    checkpoint._save_or_raise, checkpoint._write = held, written


if __name__ == "__main__":
    main()
