"""``BenchmarkConfig``: what a benchmark run measures, checked on construction (no TensorFlow).

Every field is a flag of the benchmark command (:mod:`tfpar.cli.benchmark`), with its
description as help; the swept values of the all-reduce step's options are flags derived from
:class:`tfpar.allreduce.options.StepOptions`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfpar import config_fields
from tfpar import models
from tfpar import strategies
from tfpar.config_fields import field
from tfpar.errors import ConfigError
from tfpar.training.config import AUTO
from tfpar.training.config import DTYPES

# The most steps per compiled call that tuning stores: steps=auto needs two such calls.
_MOST_TUNED_STEPS_PER_EXECUTION = 8


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
    """What the benchmark measures: strategies x device counts x models (x swept options), in
    interleaved rounds.

    Attributes:
        strategies: Registry strategies to compare (multi_worker: one local process per
            device).
        num_devices: Device counts (worker counts for multi_worker).
        models: Models to train.
        batch_size: Global batch size.
        steps: Training steps per configuration and round.
        warmup_steps: Unmeasured steps of each configuration first.
        rounds: Measured rounds (interleaved across configurations).
        threads_per_device: Intra-op threads of each device. Default: cores // the largest
            device count, so every device has the same share of the machine.
        epoch_examples: Epoch size for the sec/epoch column.
        dtype: Keras dtype policy of the models; auto: what the train command's --dtype=auto
            chooses for each configuration's devices (mixed_bfloat16 where the hardware
            computes bfloat16 natively and tuning did not find it slower), said in one line.
        jit_compile: Compile the training step with XLA.
        steps_per_execution: Training steps per compiled call; auto: what tune found faster
            on this machine kind for each configuration's devices (1 if not tuned).
        profile_steps: Trace this many steps of every configuration for TensorBoard's profiler,
            after warm-up and outside the measurements; 0: none.
        profile_dir: Where profile_steps writes the traces.
        baseline: Also measure plain Keras with no strategy on one device and TensorFlow's
            default threads (every core).
        ceiling: Also measure N plain Keras processes training side by side, one device each:
            what N devices give with no communication at all.
        communication_share: Also measure every configuration of tfpar's all-reduce step
            without its all-reduce: the table's 'in step' column is then the communication's
            share of a step in context (what overlap did not hide).
        tune: Instead of comparing, time the candidate thread layouts (threads per device,
            per-device or shared pools, inter-op threads; for a multi-worker strategy, the
            threads of each worker process on this host) for the first model and strategy on
            each device count above 1, in paired rounds, and store the fastest for this
            machine kind: strategies then lay their threads out that way (tfpar-env shows
            it). For a strategy of one process it also times several steps per compiled
            call and one worker process per device, and says what they gain.
        strategy_options: Option name to the values to sweep, e.g. ``{"algorithm": ["ring",
            "naive"]}``, for the strategies whose entries take them.
    """

    strategies: tuple[str, ...] = ("mirrored", "allreduce")
    num_devices: tuple[int, ...] = (1, 2)
    models: tuple[str, ...] = ("lenet",)
    batch_size: int = 256
    steps: int = 10
    warmup_steps: int = 3
    rounds: int = 5
    threads_per_device: int | None = None
    epoch_examples: int = 60_000
    dtype: str = field("float32", choices=(*DTYPES, AUTO))
    jit_compile: bool = False
    steps_per_execution: int | str = 1
    profile_steps: int = 0
    profile_dir: str = "tfpar_profile"
    baseline: bool = False
    ceiling: bool = False
    communication_share: bool = False
    tune: bool = False
    strategy_options: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = [name for name in self.models if name not in models.available()]
        if unknown:
            raise ConfigError(f"Unknown model(s) {', '.join(unknown)}. Available models: "
                              f"{', '.join(models.available())}.")
        for name in self.strategies:
            strategies.entry(name)
        config_fields.check_choices(self, ConfigError)
        config_fields.normalise_count_or(self, "steps_per_execution", AUTO, ConfigError)
        auto_steps = self.steps_per_execution == AUTO
        per_call = (_MOST_TUNED_STEPS_PER_EXECUTION if auto_steps
                    else int(self.steps_per_execution))
        for name, least in (("num_devices", 1), ("steps", 2 * per_call),
                            ("rounds", 1), ("warmup_steps", 0), ("profile_steps", 0),
                            ("threads_per_device", 1), ("epoch_examples", 1)):
            _at_least(name, getattr(self, name), least)
        if self.tune and AUTO in (self.dtype, self.steps_per_execution):
            which = "dtype" if self.dtype == AUTO else "steps_per_execution"
            raise ConfigError("{argument}=auto chooses from what tune stores; tune times "
                              "the precisions and steps per call itself. Give tune a fixed "
                              "value (float32 and 1 time the others).", argument=which)
        if self.tune and max(self.num_devices) < 2:
            raise ConfigError("{argument} times thread layouts of several devices (or worker "
                              "processes) on this machine: give a device count above 1. "
                              f"Received: num_devices={list(self.num_devices)}.",
                              argument="tune")
        if self.batch_size < max(self.num_devices):
            raise ConfigError(f"{{argument}} must be at least the largest device count "
                              f"({max(self.num_devices)}), so every replica gets an example. "
                              f"Received: {{argument}}={self.batch_size}.",
                              argument="batch_size")


def _at_least(name: str, value: Any, least: int) -> None:
    for v in value if isinstance(value, tuple) else (value,):
        if v is not None and v < least:  # None: threads_per_device's default.
            raise ConfigError(f"{{argument}} must be at least {least}. Received: "
                              f"{{argument}}={v}.", argument=name)
