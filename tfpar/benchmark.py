"""Throughput benchmark: steady-state images/s of strategies side by side, measured honestly.

Every configuration (strategy x device set x model) is built first; then the measurement
rounds interleave them (A, B, C, A, B, C, ...), so slow drifts of a noisy machine hit all
configurations alike. Each round trains ``steps`` steps on synthetic data after warm-up.

Ratios use each configuration's *best* round. Interference from the rest of the machine (on
the shared 2-core machines here, throttling that halves or thirds a round's speed for
seconds at a time) only ever slows a round down, so the fastest round is the best estimate of
the configuration's own speed (the reasoning of Python's ``timeit``). The median and the
spread of the rounds are reported beside it, so the noise stays visible.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfpar import data as data_lib
from tfpar import atomic_io
from tfpar import devices as devices_lib
from tfpar import flops
from tfpar import models
from tfpar import strategies

BASELINE = "keras"  # Plain single-device Keras: no strategy at all.


@dataclasses.dataclass
class Measurement:
    """The images/s of one configuration over the measurement rounds.

    Attributes:
        strategy: Strategy name, or ``"keras"`` for the plain baseline.
        devices: Device names.
        model: Model name.
        batch_size: Global batch size.
        images_per_second: One figure per round.
        training_flops_per_image: FLOPs of one training step per image (see tfpar.flops).
    """

    strategy: str
    devices: list[str]
    model: str
    batch_size: int
    images_per_second: list[float] = dataclasses.field(default_factory=list)
    training_flops_per_image: int = 0

    @property
    def best(self) -> float:
        """Best (highest) images/s over the rounds: the headline figure."""
        return max(self.images_per_second)

    @property
    def median(self) -> float:
        """Median images/s over the rounds."""
        return statistics.median(self.images_per_second)

    @property
    def gflops_per_second(self) -> float:
        """Achieved training GFLOP/s at the best images/s."""
        return self.best * self.training_flops_per_image / 1e9

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds, as a fraction."""
        return (max(self.images_per_second) - min(self.images_per_second)) / self.median


class _Runner:
    """One built configuration: runs ``steps`` training steps and returns the seconds taken."""

    def __init__(self, strategy_name, device_set, model_name, batch_size, steps, image_shape,
                 dtype):
        self.measurement = Measurement(strategy_name, list(device_set.names), model_name,
                                       batch_size)
        self.steps = steps
        if strategy_name == BASELINE:
            strategy, self.loop = tf.distribute.get_strategy(), "fit"
        else:
            strategy = strategies.get(strategy_name, device_set)
            self.loop = strategies.entry(strategy_name).training_loop
        self.strategy = strategy
        previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy(dtype)  # Layers keep the policy they are built with.
        try:
            with strategy.scope():
                self.model = models.build(model_name, num_classes=10, input_shape=image_shape)
                self.model.compile(
                    optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        finally:
            keras.mixed_precision.set_global_policy(previous)
        self.measurement.training_flops_per_image = flops.training_flops_per_image(self.model)
        rng = np.random.default_rng(0)
        images = rng.random((batch_size, *image_shape), dtype=np.float32)
        labels = rng.integers(0, 10, batch_size).astype(np.int32)
        # One cached batch repeated: the benchmark measures training, not input decoding.
        self.dataset = (tf.data.Dataset.from_tensors((images, labels)).repeat(steps)
                        .prefetch(tf.data.AUTOTUNE))

    def run(self) -> float:
        start = time.perf_counter()
        if self.loop == "allreduce":
            from tfpar import allreduce_loop
            allreduce_loop.fit(self.model, self.dataset, strategy=self.strategy, verbose=0)
        else:
            self.model.fit(self.dataset, verbose=0)
        return time.perf_counter() - start


def run(strategy_names: Sequence[str], device_sets: Sequence[devices_lib.DeviceSpec],
        model_names: Sequence[str], batch_size: int, steps: int = 10, warmup_rounds: int = 1,
        rounds: int = 5, image_shape: tuple[int, int, int] = (28, 28, 1),
        baseline: bool = False, progress: Optional[Callable[[str], None]] = print,
        dtype: str = "float32") -> list[Measurement]:
    """Measures every strategy x device set x model, interleaved; returns the measurements.

    Args:
        strategy_names: Registry names (single-process ones).
        device_sets: Device sets, e.g. ``[1, 2]``.
        model_names: Model names.
        batch_size: Global batch size.
        steps: Training steps per round.
        warmup_rounds: Unmeasured rounds first (tracing, allocator warm-up).
        rounds: Measured rounds.
        image_shape: Synthetic image shape.
        baseline: Also measure plain Keras with no strategy on one device.
        progress: Called with a line of progress text; ``None`` for silence.
        dtype: Keras dtype policy of the models (e.g. ``mixed_bfloat16``).

    Returns:
        One :class:`Measurement` per configuration.
    """
    resolved = [devices_lib.resolve(spec) for spec in device_sets]
    configs = [(s, d, m) for m in model_names for s in strategy_names for d in resolved]
    if baseline:
        configs = [(BASELINE, devices_lib.resolve(1), m) for m in model_names] + configs
    runners = [_Runner(s, d, m, batch_size, steps, image_shape, dtype) for s, d, m in configs]
    for round_index in range(warmup_rounds + rounds):
        warm = round_index < warmup_rounds
        for runner in runners:
            seconds = runner.run()
            if not warm:
                runner.measurement.images_per_second.append(steps * batch_size / seconds)
            if progress:
                m = runner.measurement
                progress(f"{'warm-up' if warm else f'round {round_index - warmup_rounds + 1}/{rounds}'}"
                         f": {m.model} {m.strategy} [{', '.join(m.devices)}] "
                         f"{steps * batch_size / seconds:.1f} images/s")
    return [runner.measurement for runner in runners]


def _rows(measurements: Sequence[Measurement]) -> list[dict]:
    rows = []
    for m in measurements:
        base = min((o for o in measurements if (o.strategy, o.model) == (m.strategy, m.model)),
                   key=lambda o: len(o.devices))
        speedup = m.best / base.best * len(base.devices)
        rows.append({"model": m.model, "strategy": m.strategy, "num_devices": len(m.devices),
                     "devices": " ".join(m.devices), "batch_size": m.batch_size,
                     "images_per_second": m.best, "median_images_per_second": m.median,
                     "spread": m.spread,
                     "gflops_per_second": m.gflops_per_second, "speedup": speedup,
                     "efficiency": speedup / len(m.devices)})
    return rows


def write_csv(path: str, measurements: Sequence[Measurement]) -> None:
    """Writes one CSV row per configuration (median figures), atomically."""
    import csv
    import io

    rows = _rows(measurements)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_io.write_text(path, text.getvalue())


def plot(path: str, measurements: Sequence[Measurement]) -> None:
    """Draws images/s and scaling efficiency against devices, a line per strategy and model.

    Needs matplotlib (``pip install -e ".[bench]"``). Written atomically as PNG.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = _rows(measurements)
    figure, (speed, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["model"], r["strategy"]) for r in rows}):
        line = sorted((r for r in rows if (r["model"], r["strategy"]) == key),
                      key=lambda r: r["num_devices"])
        devices = [r["num_devices"] for r in line]
        speed.plot(devices, [r["images_per_second"] for r in line], marker="o",
                   label=" ".join(key))
        efficiency.plot(devices, [r["efficiency"] for r in line], marker="o",
                        label=" ".join(key))
    speed.set(xlabel="devices", ylabel="images/s (best round)", title="Throughput")
    efficiency.set(xlabel="devices", ylabel="speedup / devices", title="Scaling efficiency",
                   ylim=(0, 1.2))
    for axes in (speed, efficiency):
        axes.set_xticks(sorted({r["num_devices"] for r in rows}))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    with atomic_io.atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)


def table(measurements: Sequence[Measurement], epoch_examples: int = 60_000) -> str:
    """Returns the results table.

    Columns: images/s (best round; the median and the spread (max - min) / median of the
    rounds beside it), achieved training GFLOP/s, sec/epoch for ``epoch_examples`` images,
    speedup over the same strategy and model on its smallest device set, scaling efficiency
    (speedup / devices), the ratio to the first strategy measured on the same devices and
    model (e.g. allreduce / mirrored), and to the plain Keras baseline. All ratios compare
    best rounds.
    """
    header = ("model", "strategy", "devices", "images/s", "median", "spread", "GFLOP/s",
              "sec/epoch", "speedup", "efficiency", "vs first", "vs keras")
    rows = [header]
    for m, r in zip(measurements, _rows(measurements)):
        first = next((o for o in measurements if o.strategy != BASELINE
                      and (o.devices, o.model) == (m.devices, m.model)), m)
        keras_run = next((o for o in measurements
                          if o.strategy == BASELINE and o.model == m.model), None)
        rows.append((m.model, m.strategy, f"[{', '.join(m.devices)}]", f"{m.best:.1f}",
                     f"{m.median:.1f}", f"{100 * m.spread:.0f}%", f"{m.gflops_per_second:.1f}",
                     f"{epoch_examples / m.best:.1f}", f"{r['speedup']:.2f}x",
                     f"{r['efficiency']:.2f}", f"{m.best / first.best:.3f}",
                     f"{m.best / keras_run.best:.3f}" if keras_run else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
