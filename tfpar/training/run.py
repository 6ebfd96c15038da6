"""Training runs: one configuration trained on each of several device sets.

A :class:`TrainConfig` says what to train (model, dataset, optimizer, epochs) and how
(a registry strategy). :func:`train_on_devices` runs it on one device set and returns a
:class:`RunResult` with test accuracy and timing; :func:`train_each` does that for every device
set in turn (e.g. one device, then two).

Why one module of this length: one run on one device set, from the strategy to the results
row (its callbacks, its data, its resume point), reads in the order it happens; what the
command line, the recommendations and the report add live in their own modules.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tfpar import atomic_io
from tfpar import devices as devices_lib
from tfpar import worker_contract
from tfpar.callbacks import save_interval
from tfpar.callbacks.batchnorm_statistics import AverageAtEpochEnd
from tfpar.callbacks.checkpointing import EpochCheckpoint
from tfpar.callbacks.non_finite_loss import StopOnNonFiniteLoss
from tfpar.callbacks.profiling import ProfileSteps
from tfpar.callbacks.save_on_preemption import SaveOnPreemption
from tfpar.callbacks.timing import EpochTimer
from tfpar.cluster import failures
from tfpar.cluster import preemption
from tfpar.cluster import spec as cluster_spec
from tfpar.data import loading
from tfpar.data import pipelines
from tfpar.errors import ConfigError
from tfpar.errors import NonFiniteLossError
from tfpar.errors import PeerLostError
from tfpar.host import onednn
from tfpar.host import thread_layouts
from tfpar.host.machine import cpu_flags
from tfpar.strategies.registry import StrategyChoice
from tfpar.training import evaluation
from tfpar.training import recommendations
from tfpar.training import schedules
from tfpar.training.building import build_compiled_model
from tfpar.training.building import check_compile_options
from tfpar.training.building import replica_devices
from tfpar.training.config import AUTO
from tfpar.training.config import TrainConfig


@dataclasses.dataclass
class RunResult:
    """What one training run on one device set measured.

    Attributes:
        strategy: Strategy name.
        devices: Device names of the set.
        model: Model name.
        dataset: Dataset name.
        global_batch_size: Examples per step over all replicas.
        lr: Learning rate used.
        epochs: Epochs trained.
        test_accuracy: Accuracy on the test split after training.
        sec_per_epoch: Mean seconds of the steady epochs (after the first).
        first_epoch_seconds: Seconds of the first epoch (tracing included).
        images_per_second: Training images per second over the steady epochs.
        epoch_seconds: Seconds of every epoch.
        history: Per-epoch training logs (loss, accuracy, ...).
        is_chief: Whether this process is the one that writes results (multi-worker).
        save_interval: With ``save_every_steps="auto"``, the interval of saves chosen and why,
            the line the run printed (as the times moved it, the last); else ``None``.
    """

    strategy: str
    devices: list[str]
    model: str
    dataset: str
    global_batch_size: int
    lr: float
    epochs: int
    test_accuracy: float
    sec_per_epoch: float
    first_epoch_seconds: float
    images_per_second: float
    epoch_seconds: list[float]
    history: dict[str, list[float]]
    is_chief: bool = True
    save_interval: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Returns the result as JSON-serialisable data."""
        return dataclasses.asdict(self)


def progress_verbosity(verbose: int | str, stream: Any = None) -> int:
    """Keras's ``verbose`` for ``fit``: ``"auto"`` is progress bars (1) where ``stream``
    (standard output) is a terminal, and a line per epoch (2) elsewhere, where a bar's
    carriage returns and escape codes would fill a log with redrawn lines."""
    if verbose != AUTO:
        return int(verbose)
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return 1 if isatty is not None and isatty() else 2


def train_on_devices(config: TrainConfig, devices: devices_lib.DeviceSpec,
                     splits: loading.Splits | None = None,
                     strategy: tf.distribute.Strategy | None = None,
                     callbacks: Sequence[keras.callbacks.Callback] = ()) -> RunResult:
    """Trains the configured model on one device set and evaluates it.

    Args:
        config: The configuration.
        devices: The device set (a count, names, or a ``DeviceSet``).
        splits: The loaded dataset; loaded from ``config`` when ``None``.
        strategy: The strategy, if already made (multi-worker strategies must be made before
            TensorFlow runs anything); made from ``config`` when ``None``.
        callbacks: More Keras callbacks, run after tfpar's own (timing, checkpoints).

    Returns:
        The :class:`RunResult`.

    Raises:
        TfparError: On bad configuration, devices, strategy or dataset.
    """
    device_set = devices_lib.resolve(devices)
    strategy = strategy or config.strategy.build(device_set)
    config = _chosen_for_the_machine(config, device_set, strategy)
    batch_size, lr = config.for_devices(len(device_set))
    split = recommendations.cpu_split_note(len(device_set),
                                           {name.split(":")[0] for name in device_set})
    if split and cluster_spec.is_chief(strategy):
        print(f"Note: {split}.", flush=True)
    kernels = onednn.current()
    if ("bfloat16" in config.dtype and onednn.bfloat16_without_kernels(kernels, cpu_flags())
            and any(name.startswith("CPU") for name in device_set)):
        raise ConfigError(f"{{argument}}={config.dtype} has no convolution under "
                          f"{onednn.CAP_ENV}={kernels.cap} on this AVX-512 CPU, where TensorFlow "
                          "hands bfloat16 ops to oneDNN: use float32, or start without "
                          f"{onednn.CAP_ENV}.", argument="dtype")
    if batch_size < strategy.num_replicas_in_sync:
        raise ConfigError(f"The global batch size ({batch_size}) is smaller than the number of "
                          f"replicas ({strategy.num_replicas_in_sync}); every replica needs at "
                          "least one example. Raise {argument}.", argument="batch_size")
    splits = splits or loading.load(config.dataset, config.data_dir)
    steps_per_epoch = math.ceil(splits.num_train / batch_size)
    logging.info("Training %s on %s with strategy %r (%d replicas), global batch %d, lr %g.",
                 config.model, device_set, config.strategy.name,
                 strategy.num_replicas_in_sync, batch_size, lr)
    model = _compiled_model(config, device_set, strategy, splits, steps_per_epoch, lr)
    test = pipelines.pipeline(splits.test, batch_size)
    run = _RunCallbacks.make(config, model, strategy, device_set, splits.num_train, test,
                             callbacks)
    train, fit_args = _training_data(config, splits, batch_size, steps_per_epoch,
                                     run.initial_epoch, run.callbacks)
    fit_args.update(epochs=config.epochs, initial_epoch=run.initial_epoch,
                    callbacks=run.callbacks,
                    verbose=(progress_verbosity(config.verbose)
                             if run.chief or not config.chief_only_progress else 0))
    history = _fit(model, train, fit_args, config, strategy, run.checkpoint).history
    timer = run.timer
    timed = bool(timer.epoch_seconds)  # False when a resumed run had no epoch left.
    result = RunResult(
        strategy=config.strategy.name,
        devices=replica_devices(strategy, device_set), model=config.model,
        dataset=splits.name, global_batch_size=batch_size, lr=lr, epochs=config.epochs,
        test_accuracy=(history["test_accuracy"][-1] if timed
                       else evaluation.accuracy(model, test, strategy)),
        sec_per_epoch=timer.steady_epoch_seconds if timed else math.nan,
        first_epoch_seconds=timer.first_epoch_seconds if timed else math.nan,
        images_per_second=timer.steady_images_per_second if timed else math.nan,
        epoch_seconds=list(timer.epoch_seconds), history=run.whole_history(history),
        is_chief=run.chief,
        save_interval=run.checkpoint.interval_chosen if run.checkpoint is not None else None)
    run.raise_if_stopped(result, device_set)
    return result


@dataclasses.dataclass
class _RunCallbacks:
    """The callbacks of one run, in the order ``fit`` calls them, and those whose figures the
    run's result reads.

    Attributes:
        callbacks: Every callback for ``fit``.
        timer: Epoch seconds and images/s.
        loss_guard: Stops on a non-finite loss.
        checkpoint: Per-epoch state (``None`` without ``model_dir``).
        initial_epoch: The epoch training starts at (after a resume, the next unsaved one).
        earlier: The logs of the epochs a resumed run did not train itself.
        chief: Whether this process writes logs and reports.
    """

    callbacks: list[keras.callbacks.Callback]
    timer: EpochTimer
    loss_guard: StopOnNonFiniteLoss
    checkpoint: EpochCheckpoint | None
    initial_epoch: int
    earlier: dict[str, list[float]]
    chief: bool

    @classmethod
    def make(cls, config: TrainConfig, model: keras.Model, strategy: tf.distribute.Strategy,
             device_set: devices_lib.DeviceSet, num_train: int, test: tf.data.Dataset,
             extra: Sequence[keras.callbacks.Callback]) -> _RunCallbacks:
        """tfpar's callbacks for ``config`` (timing, non-finite stop, BatchNorm average, test
        accuracy, checkpoints, the chief's logs), then ``extra``; restores a saved state."""
        timer, loss_guard = EpochTimer(num_train), StopOnNonFiniteLoss()
        callbacks: list[keras.callbacks.Callback] = [timer, loss_guard]
        if not config.sync_batchnorm and model.non_trainable_variables:
            # Per-replica BatchNorm statistics drift apart; evaluate and save their average.
            callbacks.append(AverageAtEpochEnd(strategy))
        # Test accuracy after every epoch, for the per-epoch plot (after the statistics' average).
        callbacks.append(evaluation.TestAccuracy(test, strategy))
        initial_epoch, checkpoint = 0, None
        if config.model_dir:
            checkpoint = _epoch_checkpoint(config, model, strategy, device_set)
            initial_epoch = checkpoint.restore() if config.resume else checkpoint.start_over()
            callbacks.append(checkpoint)
        chief = cluster_spec.is_chief(strategy)
        if chief:
            callbacks += _chief_logs(config, strategy, device_set)
        # Last of tfpar's: a notice stops training after the others saw the step (or epoch).
        callbacks.append(SaveOnPreemption(
            checkpoint, preemption.notice_signals(config.preemption_signal),
            config.preemption_grace_seconds, exit_process=None))
        earlier = {name: list(values) for name, values in checkpoint.history.items()
                   } if checkpoint else {}
        return cls([*callbacks, *extra], timer, loss_guard, checkpoint, initial_epoch, earlier,
                   chief)

    def raise_if_stopped(self, result: RunResult, device_set: devices_lib.DeviceSet) -> None:
        """Raises if the loss guard stopped training.

        Raises:
            NonFiniteLossError: Naming the step and the learning rate, holding ``result``.
        """
        guard = self.loss_guard
        if guard.stopped:
            raise NonFiniteLossError(
                f"Training stopped: the loss became {guard.value} at epoch "
                f"{(guard.epoch or 0) + 1}, step {(guard.step or 0) + 1}, on {device_set}. The "
                f"learning rate ({result.lr:g}) is probably too high for the batch size "
                f"({result.global_batch_size}); lower {{argument}}.", [result], argument="lr")

    def whole_history(self, history: dict[str, list]) -> dict[str, list[float]]:
        """``fit``'s history with the epochs before a resume in front (each epoch once)."""
        return {k: self.earlier.get(k, [])[:self.initial_epoch] + [float(v) for v in vs]
                for k, vs in history.items()}


def _compiled_model(config: TrainConfig, device_set: devices_lib.DeviceSet,
                    strategy: tf.distribute.Strategy, splits: loading.Splits,
                    steps_per_epoch: int, lr: float) -> keras.Model:
    """The configured model, seeded, built and compiled under ``strategy``."""
    check_compile_options(config.jit_compile, strategy, device_set)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    rate = schedules.learning_rate(
        lr, warmup_start=config.warmup_start(len(device_set)),
        warmup_steps=(max(1, round(config.warmup_epochs * steps_per_epoch))
                      if config.warmup_epochs else 0),
        total_steps=config.epochs * steps_per_epoch, decay=config.lr_decay)
    model = build_compiled_model(
        config.model, splits.image_shape, splits.num_classes, strategy,
        lambda: _optimizer(config, rate),
        dtype=config.dtype, jit_compile=config.jit_compile,
        steps_per_execution=int(config.steps_per_execution), sync_batchnorm=config.sync_batchnorm)
    loading.check_image_shape(splits, model.input_shape[1:])
    return model


def _chief_logs(config: TrainConfig, strategy: tf.distribute.Strategy,
                device_set: devices_lib.DeviceSet) -> list[keras.callbacks.Callback]:
    """The chief's TensorBoard logs and profiler trace, as ``config`` asks."""
    callbacks: list[keras.callbacks.Callback] = []
    profile_dir = config.profile_dir
    if config.logdir:
        run_dir = run_folder(config.logdir, config.strategy.name, len(device_set))
        callbacks.append(keras.callbacks.TensorBoard(run_dir, write_graph=False))
        with tf.summary.create_file_writer(os.path.join(run_dir, "tfpar")).as_default():
            tf.summary.text("device_set", ", ".join(replica_devices(strategy, device_set)),
                            step=0)
        profile_dir = run_dir  # The trace shows under the same run in TensorBoard.
    if config.profile_steps:
        # The chief's trace only: TensorFlow 2.21's profiler aborts now and then while it
        # collects the trace in another worker of a job (heap corruption, on a worker other
        # than the chief every time it was seen).
        callbacks.append(ProfileSteps(*config.profile_steps, profile_dir))
    return callbacks


def _training_data(config: TrainConfig, splits: loading.Splits, batch_size: int,
                   steps_per_epoch: int, initial_epoch: int,
                   callbacks: list[keras.callbacks.Callback]
                   ) -> tuple[tf.data.Dataset, dict[str, Any]]:
    """The training data for ``fit`` and the ``fit`` arguments it needs.

    Each epoch's order depends on (seed, epoch) only: a resumed run sees the same batches as
    an uninterrupted one. Every epoch must run exactly its steps: one endless stream does when
    steps_per_execution divides the epoch (and is twice as fast on short epochs, as Keras keeps
    its iterator); otherwise the data must end with each epoch (a callback first in
    ``callbacks`` tells the data which epoch it is). ``shuffle=False``: the order is the
    data's own (Keras would warn that it ignores shuffle).
    """
    if steps_per_epoch % int(config.steps_per_execution) == 0:
        return (pipelines.epoch_stream(splits.train, splits.num_train, batch_size,
                                       seed=config.seed, first_epoch=initial_epoch),
                dict(steps_per_epoch=steps_per_epoch, shuffle=False))
    train, data_epoch = pipelines.epoch_batches(splits.train, splits.num_train, batch_size,
                                              seed=config.seed)
    callbacks.insert(0, keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: data_epoch.assign(epoch)))
    return train, dict(shuffle=False)


def _fit(model: keras.Model, train: tf.data.Dataset, fit_args: dict[str, Any],
         config: TrainConfig, strategy: tf.distribute.Strategy,
         checkpoint: EpochCheckpoint | None) -> keras.callbacks.History:
    """``model.fit``; a worker that stopped answering ends it with one line naming it."""
    try:
        return model.fit(train, **fit_args)
    except tf.errors.OpError as e:
        tasks = failures.lost_peers(e.message) if cluster_spec.is_multi_worker(strategy) else None
        if tasks is None:
            raise
        raise PeerLostError(failures.peer_lost_message(tasks, _resume_point(config, checkpoint)),
                            unresponsive=failures.worker_indices(tasks)) from None


def _optimizer(config: TrainConfig, rate: Any) -> keras.optimizers.Optimizer:
    """The configured optimizer, at learning rate ``rate`` (a number or a schedule)."""
    if config.optimizer == "adam":
        return keras.optimizers.Adam(rate)
    return keras.optimizers.SGD(rate, momentum=config.momentum)


def _resume_point(config: TrainConfig, checkpoint: EpochCheckpoint | None) -> str:
    """Where a stopped run can resume from, in words."""
    if checkpoint is None:
        return "Nothing was saved (no model_dir); give one to resume a stopped job."
    epochs, steps = checkpoint.position
    if not epochs and not steps:
        return f"No epoch had finished; {checkpoint.directory} holds nothing to resume from."
    where = f"Epoch {epochs}" if not steps else f"Epoch {epochs + 1} step {steps}"
    return (f"{where} is the last saved in {checkpoint.directory}: run the same command "
            "on every worker to resume from it.")


def _chosen_for_the_machine(config: TrainConfig, device_set: devices_lib.DeviceSet,
                            strategy: tf.distribute.Strategy) -> TrainConfig:
    """``config`` with its ``"auto"`` precision and steps per call chosen for this machine
    (:mod:`tfpar.training.recommendations`), said in one line by the chief."""
    auto_dtype, auto_steps = config.dtype == AUTO, config.steps_per_execution == AUTO
    if not (auto_dtype or auto_steps):
        return config
    workers = cluster_spec.tasks_on_this_host(getattr(strategy, "cluster_resolver", None))
    changes, said = recommendations.chosen(
        {name.split(":")[0] for name in device_set}, len(device_set), workers,
        dtype=auto_dtype, steps_per_execution=auto_steps,
        accuracy_note=("; LeNet's test accuracy as in float32 over several runs, on the "
                       "benchmarks page"))
    if cluster_spec.is_chief(strategy):
        print(f"Chosen for this machine: {said}.", flush=True)
    return dataclasses.replace(config, **changes)


def run_folder(root: str, strategy_name: str, num_devices: int) -> str:
    """The folder of one device set's run under ``root`` (``model_dir`` or ``logdir``)."""
    return os.path.join(root, worker_contract.run_folder_name(strategy_name, num_devices))


def resuming_line(path: str, position: str) -> str:
    """The line a resumed run prints: ``Resuming from DIR/ckpt-12 (the end of epoch 2)`` (a
    checkpoint's number counts optimizer steps).

    Args:
        path: The checkpoint it resumes from.
        position: Its position in words (``EpochCheckpoint.position_of``).
    """
    return f"Resuming from {path} ({position})"


def _epoch_checkpoint(config: TrainConfig, model: keras.Model, strategy: tf.distribute.Strategy,
                      device_set: devices_lib.DeviceSet) -> EpochCheckpoint:
    directory = run_folder(config.model_dir or "", config.strategy.name, len(device_set))
    made_with = {"model": config.model, "dataset": config.dataset, "optimizer": config.optimizer,
                 "dtype": config.dtype, "sync_batchnorm": config.sync_batchnorm,
                 # A step inside an epoch means the same examples at the same global batch.
                 "global_batch_size": config.for_devices(len(device_set))[0]}
    checkpoint = EpochCheckpoint(directory, model, strategy, made_with=made_with,
                                 save_every_steps=config.save_every_steps,
                                 save_budget=config.save_budget)
    latest = checkpoint.latest
    # Printed, not logged: whether a run resumed is part of its result for the user.
    if latest and config.resume:
        print(resuming_line(latest, checkpoint.position_of(latest)), flush=True)
    elif latest:
        print(f"Not resuming: training from scratch; {directory} will be "
              "overwritten.", flush=True)
    else:
        every = ("" if not config.save_every_steps
                 else "at an interval chosen to cost at most "
                      f"{save_interval.percent(config.save_budget)} and "
                 if config.save_every_steps == AUTO
                 else f"every {config.save_every_steps} steps and ")
        print(f"No saved training state in {directory}: training from scratch; state is saved "
              f"there {every}after every epoch.", flush=True)
    return checkpoint


def _pin_for_virtual_replicas(device_sets: Sequence[devices_lib.DeviceSpec],
                              strategy: StrategyChoice) -> None:
    """World-size invariance needs kernels that compute alike on every run: one intra-op
    thread per CPU device (a kernel's sums can depend on its threads), with an inter-op
    thread per core of this process's share of the host (a worker of a job shares it with the
    job's other workers there), TensorFlow's op determinism on GPUs. Before TensorFlow
    starts."""
    if devices_lib.gpu_count():
        tf.config.experimental.enable_op_determinism()
        return
    needed = 1
    for spec in device_sets:
        parsed = devices_lib.parse(spec) if isinstance(spec, str) else spec
        if isinstance(parsed, int):
            needed = max(needed, parsed)
        elif isinstance(parsed, Sequence):
            needed = max([needed, *(int(str(name).rsplit(":", 1)[-1]) + 1 for name in parsed
                                    if "CPU" in str(name).upper())])
    tasks = 1
    if strategy.multi_process:
        options = strategy.options
        tasks = cluster_spec.tasks_on_this_host(cluster_spec.resolver(
            options.get("cluster", "auto"), options.get("worker_hosts"),
            options.get("task_index")))
    cores = max(1, (os.cpu_count() or 1) // tasks)
    devices_lib.ensure_logical_cpus(needed,
                                    layout=thread_layouts.for_virtual_replicas(needed, cores))


def train_each(config: TrainConfig, device_sets: Sequence[devices_lib.DeviceSpec],
               on_result: Callable[[RunResult], Any] | None = None) -> list[RunResult]:
    """Trains on every device set in turn (the dataset is loaded once).

    Every device set is resolved before TensorFlow runs anything, because the CPU cannot be
    split into more logical devices after that.

    Args:
        config: The configuration.
        device_sets: Device sets, e.g. ``[1, 2]``.
        on_result: Called with each :class:`RunResult` as soon as it is measured.

    Returns:
        The results, in the order of ``device_sets``.

    Raises:
        TfparError: On bad configuration, devices, strategy or dataset.
    """
    if not device_sets:
        raise ConfigError("Give at least one device set, e.g. [1, 2].")
    for folder, what in ((config.model_dir, "model_dir"), (config.logdir, "logdir"),
                         (config.profile_steps and config.profile_dir, "profile_dir")):
        if folder:  # Checked before any work, not when the first epoch ends.
            atomic_io.check_writable_dir(folder, what)
    if config.strategy.virtual_replicas:
        _pin_for_virtual_replicas(device_sets, config.strategy)
    resolved = [devices_lib.resolve(spec) for spec in device_sets]
    for root, what in ((config.model_dir, "model_dir"), (config.logdir, "logdir")):
        for device_set in resolved if root else ():
            # The folder of each device set's run, which fit would fail to write into later.
            atomic_io.check_writable_dir(
                run_folder(root or "", config.strategy.name, len(device_set)), what)
    multi_worker_strategy = None
    if config.strategy.multi_process:
        # Collective ops across processes must be set up before TensorFlow runs any op.
        if len(resolved) != 1:
            raise ConfigError(f"Strategy {config.strategy.name!r} trains one device set per run "
                              f"(its workers' local devices). Received: {len(resolved)} sets.")
        multi_worker_strategy = config.strategy.build(resolved[0])
    splits = loading.load(config.dataset, config.data_dir)
    results = []
    for device_set in resolved:
        try:
            results.append(train_on_devices(config, device_set, splits, multi_worker_strategy))
        except NonFiniteLossError as e:
            e.results = results + e.results  # What was measured so far, for the caller.
            raise
        if on_result:
            on_result(results[-1])
    return results
