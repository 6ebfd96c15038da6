"""``tfpar-train`` / ``scripts/train.py``: train on each device set and report like the seeds.

Example::

    python scripts/train.py --strategy=mirrored --model=lenet --dataset=digits \\
        --num_devices=1,2 --epochs=5
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import cast

from absl import flags

from tfpar import atomic_io
from tfpar import models
from tfpar.allreduce import options as allreduce_options
from tfpar.cli import common
from tfpar.cli import train_report as report
from tfpar.data import catalog as dataset_catalog
from tfpar.errors import ConfigError
from tfpar.errors import NonFiniteLossError
from tfpar.multiworker import cluster
from tfpar.multiworker import launcher
from tfpar.strategies import cross_device_ops
from tfpar.strategies import multi_worker_options as multi_worker
from tfpar.training import config as config_lib

FLAGS = flags.FLAGS

flags.DEFINE_string("strategy", "mirrored",
                    "Registry strategy; run with --list_strategies to see them all.")
flags.DEFINE_bool("list_strategies", False, "Print the registered strategies and exit.")
flags.DEFINE_enum("model", "lenet", models.available(), "Model to train.")
flags.DEFINE_enum("dataset", "fashion_mnist", dataset_catalog.available(),
                  "Dataset. 'digits' and 'synthetic' need no download.")
flags.DEFINE_string("data_dir", None, "TFDS data directory (TFDS's default if unset).")
flags.DEFINE_list("num_devices", ["1"],
                  "Comma list of device-set sizes to train on in turn, e.g. 1,2 (the seeds' "
                  "num_gpus=1 then 2). GPUs when there are enough, else logical CPU devices.")
flags.DEFINE_string("devices", None,
                    "One device set by name instead, e.g. GPU:0,GPU:1 or CPU:0,CPU:1.")
flags.DEFINE_integer("batch_size", 64, "Global batch size (over all replicas).")
flags.DEFINE_float("lr", 0.05, "Learning rate.")
flags.DEFINE_bool("scale_with_devices", False,
                  "Multiply --batch_size and --lr by the number of devices of each set "
                  "(the seeds: 256/0.1 on one GPU, 512/0.2 on two).")
flags.DEFINE_float("warmup_epochs", 0.0,
                   "Raise the learning rate linearly over this many epochs: from --lr to the "
                   "scaled rate with --scale_with_devices (Goyal et al.), else from 0.")
flags.DEFINE_enum("optimizer", "sgd", list(config_lib.OPTIMIZERS), "Optimizer.")
flags.DEFINE_float("momentum", 0.9, "SGD momentum (0 gives the seeds' plain SGD).")
flags.DEFINE_integer("epochs", 10, "Training epochs.")
flags.DEFINE_integer("seed", 0, "Seed of weights and shuffling.")
flags.DEFINE_bool("sync_batchnorm", False,
                  "Synchronise BatchNorm statistics across replicas (ResNet-18).")
flags.DEFINE_enum("cross_device_ops", "auto", list(cross_device_ops.CROSS_DEVICE_OPS),
                  "Gradient reduction of the 'mirrored' strategy; auto: NCCL on GPUs, "
                  "reduction to one device otherwise.")
flags.DEFINE_enum("allreduce", "collective", list(allreduce_options.ALGORITHMS),
                  "All-reduce algorithm of the 'allreduce' strategy's hand-written step.")
flags.DEFINE_integer("bytes_per_pack", allreduce_options.DEFAULT_BYTES_PER_PACK,
                     "'allreduce', 'multi_worker*': gradient bucket size in bytes; buckets are "
                     "all-reduced from the last layer to the first, each as soon as it is "
                     "ready, overlapping the backward pass ('allreduce*': 0 is one reduction "
                     "per variable; 'multi_worker': 0 is one reduction after the whole "
                     "backward pass).")
flags.DEFINE_enum("gradient_compression", "none", list(allreduce_options.COMPRESSIONS),
                  "'allreduce*': the dtype gradients travel in (cast back to float32 after).")
flags.DEFINE_integer("accumulation_steps", 1,
                     "'allreduce*': each update trains this many micro-batches of "
                     "--batch_size, one after the other, with one all-reduce: exactly one step "
                     "on a batch this many times larger, with as many times fewer all-reduces.")
flags.DEFINE_integer("steps_per_execution", 1, "Training steps per compiled call.")
flags.DEFINE_enum("dtype", "float32", list(config_lib.DTYPES),
                  "Keras dtype policy; mixed_float16 trains with dynamic loss scaling.")
flags.DEFINE_bool("jit_compile", False,
                  "Compile the training step with XLA (one CPU device, or GPUs).")
flags.DEFINE_list("profile_steps", None,
                  "first,last steps to trace for TensorBoard's profiler, e.g. 10,15.")
flags.DEFINE_string("profile_dir", "tfpar_profile", "Where --profile_steps writes the trace.")
flags.DEFINE_string("plot", None,
                    "Draw test accuracy and training loss per epoch for each device set, and "
                    "sec/epoch with the speedup, to this PNG file (needs matplotlib).")
flags.DEFINE_string("logdir", None,
                    "Write TensorBoard logs here, one run per device set "
                    "(DIR/{strategy}_{n}_devices); view with `tensorboard --logdir=DIR`.")
flags.DEFINE_list("split_weights", None,
                  "'allreduce': per-device shares of each batch, e.g. 3,1 for a fast and a slow "
                  "device (an even split if unset).")
flags.DEFINE_enum("implementation", "auto", list(multi_worker.IMPLEMENTATIONS),
                  "'multi_worker*': collective implementation (nccl: GPUs only).")
flags.DEFINE_enum("cluster", "auto", list(cluster.SOURCES),
                  "'multi_worker*': where the cluster comes from (auto: --worker_hosts, else "
                  "TF_CONFIG, else SLURM).")
flags.DEFINE_list("worker_hosts", None, "'multi_worker*': host:port of every worker.")
flags.DEFINE_integer("task_index", None,
                     "'multi_worker*': this worker's index in --worker_hosts.")
flags.DEFINE_float("cluster_timeout", cluster.DEFAULT_TIMEOUT_SECONDS,
                   "'multi_worker*': seconds a worker waits for its peers to come up (it says "
                   "which it is waiting for every few seconds) before giving up.")
flags.DEFINE_float("heartbeat_timeout", None,
                   "'multi_worker*': seconds without a heartbeat after which a worker counts as "
                   "lost and the job stops with one line naming it (default: TensorFlow's, "
                   "10 s).")
flags.DEFINE_string("model_dir", None,
                    "Save training state here after every epoch (one sub-folder per device "
                    "set), to resume after a crash or kill.")
flags.DEFINE_bool("resume", True,
                  "Resume from the state in --model_dir when there is some (--noresume "
                  "starts from scratch and overwrites it).")
flags.DEFINE_bool("deterministic", False,
                  "Deterministic TensorFlow ops: with --seed, two runs on the same device set "
                  "give identical weights and accuracy.")
flags.DEFINE_string("output", None, "Write all results to this JSON file.")
flags.DEFINE_integer("verbose", 1, "Keras verbosity: 1 progress bars, 2 a line per epoch, 0 none.")


# Library arguments whose flag has another name (errors about them name the flag).
OPTION_FLAGS = {"algorithm": "allreduce"}

# How --help groups the flags (every flag of this module appears in exactly one group).
HELP_GROUPS = {
    "What to train": ("model", "dataset", "data_dir", "epochs", "batch_size", "lr",
                      "scale_with_devices", "warmup_epochs", "optimizer", "momentum", "seed",
                      "dtype"),
    "Devices and strategy": ("strategy", "list_strategies", "num_devices", "devices",
                             "cross_device_ops", "sync_batchnorm"),
    "The hand-written all-reduce step (allreduce*)": ("allreduce", "bytes_per_pack",
                                                      "gradient_compression",
                                                      "accumulation_steps", "split_weights"),
    "Several workers (multi_worker*)": ("implementation", "cluster", "worker_hosts",
                                        "task_index", "cluster_timeout",
                                        "heartbeat_timeout"),
    "Speed": ("steps_per_execution", "jit_compile", "deterministic"),
    "Results, logs and state": ("output", "plot", "logdir", "profile_steps", "profile_dir",
                                "model_dir", "resume", "verbose"),
}


def config_from_flags() -> tuple[config_lib.TrainConfig, list]:
    """Returns the training configuration and the device sets the flags ask for.

    Raises:
        TfparError: If a flag value is invalid.
    """
    device_sets = ([FLAGS.devices] if FLAGS.devices
                   else [common.parse_count("--num_devices", n) for n in FLAGS.num_devices])
    # Checked first without TensorFlow (the strategy options need the registry, which imports it).
    config = config_lib.TrainConfig(
        strategy=FLAGS.strategy, model=FLAGS.model,
        dataset=FLAGS.dataset, data_dir=FLAGS.data_dir, batch_size=FLAGS.batch_size,
        lr=FLAGS.lr, scale_with_devices=FLAGS.scale_with_devices,
        warmup_epochs=FLAGS.warmup_epochs, optimizer=FLAGS.optimizer,
        momentum=FLAGS.momentum, epochs=FLAGS.epochs, seed=FLAGS.seed,
        sync_batchnorm=FLAGS.sync_batchnorm, verbose=FLAGS.verbose,
        # The launcher's --all_output reaches the workers through their environment.
        chief_only_progress=os.environ.get(launcher.ALL_OUTPUT_ENV) != "1",
        model_dir=FLAGS.model_dir,
        resume=FLAGS.resume, deterministic=FLAGS.deterministic, dtype=FLAGS.dtype,
        jit_compile=FLAGS.jit_compile, steps_per_execution=FLAGS.steps_per_execution,
        # Two steps, first and last (TrainConfig checks how many were given).
        profile_steps=(cast(tuple[int, int], tuple(common.parse_count("--profile_steps", n)
                                                   for n in FLAGS.profile_steps))
                       if FLAGS.profile_steps else None),
        profile_dir=FLAGS.profile_dir, logdir=FLAGS.logdir)
    options = common.strategy_options(FLAGS.strategy, {
        "cross_device_ops": FLAGS.cross_device_ops, "algorithm": FLAGS.allreduce,
        "bytes_per_pack": FLAGS.bytes_per_pack,
        "gradient_compression": FLAGS.gradient_compression,
        "accumulation_steps": FLAGS.accumulation_steps,
        "split_weights": (tuple(common.parse_positive_float("--split_weights", w)
                                for w in FLAGS.split_weights) if FLAGS.split_weights else None),
        "implementation": FLAGS.implementation, "cluster": FLAGS.cluster,
        "worker_hosts": tuple(FLAGS.worker_hosts) if FLAGS.worker_hosts else None,
        "task_index": FLAGS.task_index, "cluster_timeout": FLAGS.cluster_timeout,
        "heartbeat_timeout": FLAGS.heartbeat_timeout,
    }, flag_names=OPTION_FLAGS)
    return dataclasses.replace(config, strategy_options=options), device_sets


def main(argv: list[str]) -> None:
    """Trains on each device set, printing the seeds' line per set and a final table."""
    del argv  # run_main refuses positional arguments.
    if FLAGS.list_strategies:
        print(common.strategy_listing())
        return
    config, device_sets = config_from_flags()
    from tfpar import strategies  # Imports TensorFlow.

    strategies.entry(config.strategy)  # Fail on a bad name before any slow work.
    if config.sync_batchnorm and "synchronized_batchnorm" not in models.options(config.model):
        raise ConfigError(f"--sync_batchnorm needs a model with BatchNorm layers; "
                          f"--model={config.model} has none. Use --model=resnet18, or drop "
                          "--sync_batchnorm.")
    if FLAGS.output:
        atomic_io.check_writable(FLAGS.output)
    if FLAGS.plot:
        report.check_plotting()
        atomic_io.check_writable(FLAGS.plot)
    # Under the launcher only the chief reports (every worker would print the same figures),
    # unless it was asked to show every worker's output.
    all_output = not config.chief_only_progress

    from tfpar.training import run as training  # TensorFlow: only once flags are checked.

    def report_line(result: training.RunResult) -> None:
        if result.is_chief or all_output:
            print(report.summary_line(result), flush=True)

    try:
        results = training.train_each(config, device_sets, on_result=report_line)
    except NonFiniteLossError as e:
        _write_results(config, e.results, "What was measured before the loss diverged")
        raise
    if results[0].is_chief or all_output:
        print()
        print(report.table(results))
    _write_results(config, results, "Results")
    if FLAGS.plot and results[0].is_chief:
        report.write_curves(FLAGS.plot, results)
        print(f"Plot written to {FLAGS.plot}")


def _write_results(config: config_lib.TrainConfig, results: list, what: str) -> None:
    if FLAGS.output and results and results[0].is_chief:
        payload = {"config": dataclasses.asdict(config),
                   "results": [r.to_dict() for r in results]}
        try:
            atomic_io.write_json(FLAGS.output, payload)
        except OSError as e:
            # The run is over: its figures must not be lost with the file.
            print(json.dumps(atomic_io.json_safe(payload), indent=2, sort_keys=True))
            raise ConfigError(f"Could not write --output={FLAGS.output} ({e.strerror}); the "
                              "results are printed above.") from None
        print(f"{what} written to {FLAGS.output}")


def run() -> None:
    """Console-script entry point (``tfpar-train``)."""
    common.run_main(main, __name__, HELP_GROUPS, aliases=OPTION_FLAGS)


if __name__ == "__main__":
    run()
