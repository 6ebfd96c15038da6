"""``tfpar-train``: train on each device set and report accuracy and speed.

Example::

    tfpar-train --strategy=mirrored --model=lenet --dataset=digits \\
        --num_devices=1,2 --epochs=5
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import flags

from tfpar import atomic_io
from tfpar import config_fields
from tfpar import models
from tfpar import worker_contract
from tfpar.allreduce.options import StepOptions
from tfpar.cli import common
from tfpar.cli import config_flags
from tfpar.cli import train_report as report
from tfpar.cluster import gpus
from tfpar.cluster import preemption
from tfpar.cluster import slurm
from tfpar.errors import ConfigError
from tfpar.errors import NonFiniteLossError
from tfpar.host import machine
from tfpar.strategies.cross_device_ops import ReductionOptions
from tfpar.strategies.multi_worker_options import MultiWorkerOptions
from tfpar.training import config as config_lib

FLAGS = flags.FLAGS

# Every field of the training configuration and of the strategies' option groups is a flag
# (types, defaults, help and choices from the classes); the program's own flags follow.
# The strategy is a value made of --strategy and the option flags its entry takes; progress
# output comes from the launcher.
_NOT_FLAGS = ("strategy", "chief_only_progress")
config_flags.define(config_lib.TrainConfig, exclude=_NOT_FLAGS)
flags.DEFINE_string(
    "strategy", config_fields.default_of(config_lib.TrainConfig, "strategy").name,
    "Registry strategy; --list_strategies prints them all. Its options are the flags of the "
    "groups below that it takes.")
OPTION_GROUPS = (ReductionOptions, StepOptions, MultiWorkerOptions)
# Each option group's flags, as defined from its class (--help lists them together).
_GROUP_FLAGS = {group: tuple(config_flags.define(group)) for group in OPTION_GROUPS}
flags.DEFINE_bool("list_strategies", False, "Print the registered strategies and exit.")
flags.DEFINE_list("num_devices", ["1"],
                  "Comma list of device-set sizes to train on in turn, e.g. 1,2 (one device, then "
                  "two). GPUs when there are enough, else logical CPU devices.")
flags.DEFINE_string("devices", None,
                    "One device set by name instead, e.g. GPU:0,GPU:1 or CPU:0,CPU:1.")
flags.DEFINE_string("plot", None,
                    "Draw test accuracy and training loss per epoch for each device set, and "
                    "sec/epoch with the speedup, to this PNG file (needs matplotlib).")
flags.DEFINE_string("output", None, "Write all results to this JSON file.")


# Library arguments whose flag has another name (errors about them name the flag).
OPTION_FLAGS = {name: flag for group in OPTION_GROUPS
                for name, flag in config_flags.flag_names(group).items()}

# How --help groups the flags (every flag of this module appears in exactly one group).
HELP_GROUPS = {
    "What to train": ("model", "dataset", "data_dir", "epochs", "batch_size", "lr",
                      "scale_with_devices", "warmup_epochs", "lr_decay", "optimizer", "momentum",
                      "seed", "dtype"),
    "Devices and strategy": ("strategy", "list_strategies", "num_devices", "devices",
                             *_GROUP_FLAGS[ReductionOptions], "sync_batchnorm"),
    "The hand-written all-reduce step (allreduce*)": _GROUP_FLAGS[StepOptions],
    "Several workers (multi_worker*)": _GROUP_FLAGS[MultiWorkerOptions],
    "Speed": ("steps_per_execution", "jit_compile", "deterministic"),
    "Results, logs and state": ("output", "plot", "logdir", "profile_steps", "profile_dir",
                                "model_dir", "save_every_steps", "save_budget", "resume",
                                "preemption_signal", "preemption_grace_seconds", "verbose"),
}


def config_from_flags() -> tuple[config_lib.TrainConfig, list]:
    """Returns the training configuration and the device sets the flags ask for.

    Raises:
        TfparError: If a flag value is invalid.
    """
    device_sets = ([FLAGS.devices] if FLAGS.devices
                   else [common.parse_count("--num_devices", n, most=machine.MAX_LOGICAL_CPUS)
                         for n in FLAGS.num_devices])
    given = _gpus_given()
    if given and not FLAGS.devices and not FLAGS["num_devices"].present:
        device_sets = [given]  # A worker trains on the GPUs it was given.
    values = {}
    for group in OPTION_GROUPS:  # Each option group checks its values on construction.
        values.update(dataclasses.asdict(group(**config_flags.values(group))))
    # The strategy is resolved here, once: the config carries the choice.
    choice = common.strategy_choice(FLAGS.strategy, values, flag_names=OPTION_FLAGS)
    config = config_lib.TrainConfig(
        **{**config_flags.values(config_lib.TrainConfig, exclude=_NOT_FLAGS), "strategy": choice},
        # The launcher's --all_output reaches the workers through their environment.
        chief_only_progress=os.environ.get(worker_contract.ALL_OUTPUT_ENV) != "1")
    return config, device_sets


def _gpus_given() -> int:
    """How many GPUs this worker was given: by tfpar's launcher, or to a Slurm task (by Slurm,
    or its share of the node's, pinned here before anything starts CUDA); 0 otherwise."""
    slurm.pin_gpus()
    if worker_contract.SLOT_ENV not in os.environ:
        return slurm.given_gpus(os.environ)
    return len(gpus.visible_gpus(os.environ, which=lambda _: None))


def main(argv: list[str]) -> None:
    """Trains on each device set, printing a summary line per set and a final table."""
    del argv  # run_main refuses positional arguments.
    if FLAGS.list_strategies:
        print(common.strategy_listing(OPTION_FLAGS))
        return
    config, device_sets = config_from_flags()
    _check_restartable(config)
    # A notice from here on stops the program with the preempted status: at once before and
    # after training, at the job's agreed step during it (saving the state with --model_dir).
    preemption.NOTICE.watch(preemption.notice_signals(config.preemption_signal),
                             config.preemption_grace_seconds, exit_process=True)
    try:
        _train_and_report(config, device_sets)
    finally:  # A process that runs main and goes on (a test) gets its handlers back.
        preemption.NOTICE.unwatch()


def _check_restartable(config: config_lib.TrainConfig) -> None:
    """Under a launcher that starts the job again after a failure, the state must be saved and
    resumed: refused in one line otherwise (a restart would train from scratch again)."""
    if os.environ.get(worker_contract.RESTARTS_ENV) != "1":
        return
    if config.model_dir and config.resume:
        return
    wanted = [] if config.model_dir else ["give --model_dir=DIR, where the state is saved"]
    wanted += [] if config.resume else ["drop --noresume"]
    raise ConfigError("The launcher starts this job again after a failure, from its last saved "
                      f"state: {', and '.join(wanted)}.")


def _train_and_report(config: config_lib.TrainConfig, device_sets: list) -> None:
    """Checks the outputs, trains on each device set and writes the lines, table and files."""
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
        payload = {"config": config.to_dict(),
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
