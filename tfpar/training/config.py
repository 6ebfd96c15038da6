"""``TrainConfig``: what a training run trains and how, checked on construction (no TensorFlow).

Kept apart from :mod:`tfpar.training` so that command-line programs can check their flags
before TensorFlow is imported.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tfpar import config_fields
from tfpar import models
from tfpar.callbacks import save_interval
from tfpar.cluster import preemption
from tfpar.config_fields import field
from tfpar.data import catalog
from tfpar.errors import ConfigError
from tfpar.strategies import registry
from tfpar.strategies.registry import StrategyChoice

OPTIMIZERS = ("sgd", "adam")
"""The train command's optimizers."""
LR_DECAYS = ("constant", "cosine")
"""How the learning rate changes after the warm-up (tfpar.training.schedules.learning_rate)."""
DTYPES = ("float32", "bfloat16", "mixed_float16", "mixed_bfloat16")
"""The Keras dtype policies the train command takes (besides ``auto``)."""
AUTO = "auto"
"""What the train command also takes: chosen for the hardware (tfpar.training.recommendations)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and how. Batch size and learning rate are those of a one-device run.

    Every field is a flag of the train command (:mod:`tfpar.cli.train`), with this text as
    its help.

    Attributes:
        strategy: Registry strategy; --list_strategies prints them all. In Python, a
            :class:`tfpar.strategies.StrategyChoice` (``tfpar.strategies.choose(name,
            **options)``); a name is taken as the entry with its default options.
        model: Model to train.
        dataset: Dataset; 'digits' and 'synthetic' need no download.
        data_dir: TFDS data directory (TFDS's default if unset).
        batch_size: Global batch size (over all replicas) of a forward and backward pass; a
            step (one update) trains ``accumulation_steps`` such micro-batches when the
            strategy takes that option.
        lr: Learning rate.
        scale_with_devices: Multiply batch size and learning rate by the number of devices of
            each set (e.g. 256 and 0.1 on one GPU become 512 and 0.2 on two).
        warmup_epochs: Raise the learning rate linearly over this many epochs: from ``lr`` to
            the scaled rate with ``scale_with_devices`` on several devices (Goyal et al.), else
            from 0 (0: no warm-up).
        lr_decay: After the warm-up, keep the learning rate (constant) or decay it to 0 at the
            end of the last epoch along a half cosine (cosine).
        optimizer: Optimizer (SGD with ``momentum``, or Adam).
        momentum: SGD momentum (0: plain SGD).
        epochs: Training epochs.
        seed: Seed of weights and shuffling.
        sync_batchnorm: Compute BatchNorm statistics over the global batch (ResNet-18).
        verbose: Keras verbosity: 1 progress bars, 2 a line per epoch, 0 none; auto: progress
            bars where the output is a terminal, else a line per epoch (a log file, a pipe,
            the launcher's prefixed worker output).
        chief_only_progress: In multi-worker training, only the chief shows progress and
            reports (the other workers train silently).
        model_dir: Save training state here after every epoch and at a preemption notice (one
            sub-folder per device set), to resume after a crash, kill or preemption; unset: not
            saved.
        save_every_steps: With ``model_dir``, also save inside an epoch after every this many
            of its steps, so that a kill without notice loses at most that many (0: at
            epochs' ends and notices only); a run resumes at the step saved, bit for bit.
            auto: the most frequent interval whose saves cost at most save_budget of the
            training time, from the run's steps and saves as timed (one process).
        save_budget: With save_every_steps=auto, the largest fraction of the training time
            saving may take.
        resume: Resume from the state in ``model_dir`` when there is some (false starts from
            scratch and overwrites it).
        preemption_signal: The preemption notice besides SIGTERM (e.g. what Slurm's
            --signal sends); on a notice every worker stops after the same step, saves the
            state there (with model_dir) and exits with status 85 (none: SIGTERM only).
        preemption_grace_seconds: Seconds from a preemption notice to the end of the process
            at the latest (keep it below the scheduler's grace period: Kubernetes' default is
            30 s; at most 86400, a day); past them the last complete state is kept.
        deterministic: Deterministic TensorFlow ops: with ``seed``, two runs on the same device
            set give identical weights and accuracy (slower on GPUs).
        dtype: Keras dtype policy; mixed_float16 trains with dynamic loss scaling; auto:
            mixed_bfloat16 where the hardware computes bfloat16 natively (AMX-BF16,
            AVX512-BF16, GPUs from compute capability 8.0), else float32, said in one line.
        jit_compile: Compile the training step with XLA (one CPU device, or GPUs).
        steps_per_execution: Training steps per compiled call; auto: what
            tfpar-benchmark --tune found faster on this machine kind (1 if not tuned).
        profile_steps: first,last steps to trace for TensorBoard's profiler, e.g. 10,15.
        profile_dir: Where ``profile_steps`` writes the trace.
        logdir: Write TensorBoard logs here, one run per device set
            (DIR/{strategy}_{n}_devices): per epoch, Keras's scalars (loss, accuracy, learning
            rate) and tfpar's (test accuracy, epoch seconds, images/s), the device set as text,
            and the ``profile_steps`` trace; only the chief writes. View them with
            `tensorboard --logdir=DIR`.
    """

    strategy: StrategyChoice = field(default_factory=lambda: registry.choose("mirrored"))
    model: str = field("lenet", choices=models.available)
    dataset: str = field("fashion_mnist", choices=catalog.available)
    data_dir: str | None = None
    batch_size: int = 64
    lr: float = 0.05
    scale_with_devices: bool = False
    warmup_epochs: float = 0.0
    lr_decay: str = field("constant", choices=LR_DECAYS)
    optimizer: str = field("sgd", choices=OPTIMIZERS)
    momentum: float = 0.9
    epochs: int = 10
    seed: int = 0
    sync_batchnorm: bool = False
    verbose: int | str = AUTO
    chief_only_progress: bool = True
    model_dir: str | None = None
    save_every_steps: int | str = 0
    save_budget: float = save_interval.BUDGET
    resume: bool = True
    preemption_signal: str = field(preemption.DEFAULT_NOTICE_SIGNAL,
                                   choices=preemption.NOTICE_SIGNALS)
    preemption_grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS
    deterministic: bool = False
    dtype: str = field("float32", choices=(*DTYPES, AUTO))
    jit_compile: bool = False
    steps_per_execution: int | str = 1
    profile_steps: tuple[int, int] | None = None
    profile_dir: str = "tfpar_profile"
    logdir: str | None = None

    def __post_init__(self):
        config_fields.check_choices(self, ConfigError)
        self._resolve_strategy()
        received = "Received: {argument}="
        _check(isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size",
               f"{{argument}} must be an integer >= 1. {received}{self.batch_size!r}.")
        _check(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
               "lr", f"{{argument}} must be a finite number > 0. {received}{self.lr!r}.")
        _check(isinstance(self.warmup_epochs, (int, float))
               and not isinstance(self.warmup_epochs, bool)
               and 0 <= self.warmup_epochs < math.inf, "warmup_epochs",
               f"{{argument}} must be a number >= 0. {received}{self.warmup_epochs!r}.")
        _check(isinstance(self.epochs, int) and self.epochs >= 1, "epochs",
               f"{{argument}} must be an integer >= 1. {received}{self.epochs!r}.")
        object.__setattr__(self, "save_every_steps",
                           save_interval.checked_interval(self.save_every_steps))
        object.__setattr__(self, "save_budget", save_interval.checked_budget(self.save_budget))
        _check(self.save_budget == save_interval.BUDGET or self.save_every_steps == AUTO,
               "save_budget", f"{{argument}} applies only with save_every_steps={AUTO}. "
               f"Received: save_every_steps={self.save_every_steps!r}.")
        _check(0 <= self.momentum < 1, "momentum",
               f"{{argument}} must be in [0, 1). {received}{self.momentum!r}.")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**32, "seed",
               f"{{argument}} must be an integer from 0 to 2**32 - 1. {received}{self.seed!r}.")
        config_fields.normalise_count_or(self, "steps_per_execution", AUTO, ConfigError)
        if isinstance(self.verbose, str) and self.verbose.isdigit():
            object.__setattr__(self, "verbose", int(self.verbose))
        _check(self.verbose in (0, 1, 2, AUTO) and not isinstance(self.verbose, bool), "verbose",
               f"{{argument}} must be 0, 1, 2 or {AUTO!r}. {received}{self.verbose!r}.")
        if self.dataset not in catalog.OFFLINE_DATASETS:  # The offline ones read no folder.
            catalog.check_data_dir(self.data_dir)
        preemption.check_grace_seconds(self.preemption_grace_seconds)
        _check(self.profile_steps is None or (len(self.profile_steps) == 2
                                              and 1 <= self.profile_steps[0]
                                              <= self.profile_steps[1]), "profile_steps",
               f"{{argument}} is (first, last) with 1 <= first <= last. "
               f"{received}{self.profile_steps!r}.")

    def _resolve_strategy(self) -> None:
        """Makes ``strategy`` a :class:`StrategyChoice` (a name: its entry's defaults)."""
        choice = self.strategy
        if isinstance(choice, str):
            choice = registry.choose(choice)
        elif not isinstance(choice, StrategyChoice):
            raise ConfigError("{argument} must be a registry name or a "
                              "tfpar.strategies.StrategyChoice (tfpar.strategies.choose). "
                              f"Received: {{argument}}={choice!r}.", argument="strategy")
        object.__setattr__(self, "strategy", choice)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values: every field, the strategy as its registry name and
        its options under ``strategy_options``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["strategy"] = self.strategy.name
        values["strategy_options"] = dict(self.strategy.options)
        return values

    def for_devices(self, num_devices: int) -> tuple[int, float]:
        """Returns ``(global batch size of a step, learning rate)`` for ``num_devices``.

        A step's batch is ``batch_size`` (times the devices with ``scale_with_devices``)
        times the strategy's ``accumulation_steps``: that many micro-batches of the former.
        """
        micro_batches = self.strategy.micro_batches
        if self.scale_with_devices:
            return self.batch_size * num_devices * micro_batches, self.lr * num_devices
        return self.batch_size * micro_batches, self.lr

    def warmup_start(self, num_devices: int) -> float:
        """The learning rate that warm-up starts from: the single-device ``lr`` when it is
        scaled with the devices (Goyal et al.), else 0."""
        return self.lr if self.scale_with_devices and num_devices > 1 else 0.0


def _check(ok: bool, argument: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, argument=argument)
