"""Throughput benchmark: steady-state images/s of strategies side by side, measured honestly.

Every configuration (strategy x device set x model) is built first; then the measurement
rounds interleave them (A, B, C, A, B, C, ...), so slow drifts of a noisy machine hit all
configurations alike. Each round trains ``steps`` steps on synthetic data after warm-up; the
median over rounds is reported with its spread.
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
from tfpar import devices as devices_lib
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
    """

    strategy: str
    devices: list[str]
    model: str
    batch_size: int
    images_per_second: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        """Median images/s over the rounds."""
        return statistics.median(self.images_per_second)

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds, as a fraction."""
        return (max(self.images_per_second) - min(self.images_per_second)) / self.median


class _Runner:
    """One built configuration: runs ``steps`` training steps and returns the seconds taken."""

    def __init__(self, strategy_name, device_set, model_name, batch_size, steps, image_shape):
        self.measurement = Measurement(strategy_name, list(device_set.names), model_name,
                                       batch_size)
        self.steps = steps
        if strategy_name == BASELINE:
            strategy, self.loop = tf.distribute.get_strategy(), "fit"
        else:
            strategy = strategies.get(strategy_name, device_set)
            self.loop = strategies.entry(strategy_name).training_loop
        self.strategy = strategy
        with strategy.scope():
            self.model = models.build(model_name, num_classes=10, input_shape=image_shape)
            self.model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
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
        baseline: bool = False, progress: Optional[Callable[[str], None]] = print
        ) -> list[Measurement]:
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

    Returns:
        One :class:`Measurement` per configuration.
    """
    resolved = [devices_lib.resolve(spec) for spec in device_sets]
    configs = [(s, d, m) for m in model_names for s in strategy_names for d in resolved]
    if baseline:
        configs = [(BASELINE, devices_lib.resolve(1), m) for m in model_names] + configs
    runners = [_Runner(s, d, m, batch_size, steps, image_shape) for s, d, m in configs]
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


def table(measurements: Sequence[Measurement], epoch_examples: int = 60_000) -> str:
    """Returns the results table.

    Columns: images/s (median of rounds, with the spread), sec/epoch for ``epoch_examples``
    images, speedup over the same strategy and model on its first (smallest) device set,
    scaling efficiency (speedup / devices), and the ratio to the first strategy measured on
    the same devices and model (e.g. allreduce / mirrored).
    """
    header = ("model", "strategy", "devices", "images/s", "spread", "sec/epoch", "speedup",
              "efficiency", "vs first")
    rows = [header]
    for m in measurements:
        same_strategy = [o for o in measurements if (o.strategy, o.model) == (m.strategy, m.model)]
        base = min(same_strategy, key=lambda o: len(o.devices))
        speedup = m.median / base.median * len(base.devices)
        first = next(o for o in measurements if (o.devices, o.model) == (m.devices, m.model))
        rows.append((m.model, m.strategy, f"[{', '.join(m.devices)}]", f"{m.median:.1f}",
                     f"{100 * m.spread:.0f}%", f"{epoch_examples / m.median:.1f}",
                     f"{speedup:.2f}x", f"{speedup / len(m.devices):.2f}",
                     f"{m.median / first.median:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
