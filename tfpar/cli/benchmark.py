"""``scripts/benchmark.py``: images/s of strategies x device counts x models, side by side.

Example::

    python scripts/benchmark.py --strategies=mirrored,allreduce,multi_worker \\
        --num_devices=1,2 --models=lenet --baseline
"""

from __future__ import annotations

from absl import flags

from tfpar import atomic_io
from tfpar import env
from tfpar import models
from tfpar import strategies
from tfpar.allreduce import options as allreduce_options
from tfpar.benchmark import configuration
from tfpar.benchmark import report as benchmark_report
from tfpar.benchmark import runner
from tfpar.cli import common
from tfpar.errors import ConfigError
from tfpar.strategies import multi_worker_options
from tfpar.training import config as config_lib

FLAGS = flags.FLAGS

flags.DEFINE_list("strategies", ["mirrored", "allreduce"],
                  "Registry strategies to compare (multi_worker: one local process per device).")
flags.DEFINE_list("num_devices", ["1", "2"], "Device counts (worker counts for multi_worker).")
flags.DEFINE_list("models", ["lenet"], f"Models, of {', '.join(models.available())}.")
flags.DEFINE_integer("batch_size", 256, "Global batch size.")
flags.DEFINE_integer("steps", 10, "Training steps per configuration and round.")
flags.DEFINE_integer("warmup_steps", 3, "Unmeasured steps of each configuration first.")
flags.DEFINE_integer("rounds", 5, "Measured rounds (interleaved across configurations).")
flags.DEFINE_integer("threads_per_device", None,
                     "Intra-op threads of each device. Default: cores // the largest device "
                     "count, so every device has the same share of the machine.")
flags.DEFINE_integer("epoch_examples", 60_000, "Epoch size for the sec/epoch column.")
flags.DEFINE_enum("dtype", "float32", list(config_lib.DTYPES),
                  "Keras dtype policy of the models.")
flags.DEFINE_bool("jit_compile", False, "Compile the training step with XLA.")
flags.DEFINE_integer("steps_per_execution", 1, "Training steps per compiled call.")
flags.DEFINE_integer("profile_steps", 0,
                     "Trace this many steps of every configuration for TensorBoard's profiler, "
                     "after warm-up and outside the measurements; 0: none.")
flags.DEFINE_string("profile_dir", "tfpar_profile", "Where --profile_steps writes the traces.")
flags.DEFINE_bool("baseline", False, "Also measure plain Keras with no strategy on one device "
                  "and TensorFlow's default threads (every core).")
flags.DEFINE_bool("ceiling", False, "Also measure N plain Keras processes training side by "
                  "side, one device each: what N devices give with no communication at all.")
flags.DEFINE_list("allreduce", None,
                  "All-reduce algorithms to sweep for the strategies that take one (allreduce), "
                  "e.g. collective,ring,naive; the entry's default if unset.")
flags.DEFINE_list("bytes_per_pack", None,
                  "Gradient bucket sizes in bytes to sweep for the strategies that take one "
                  "(allreduce, multi_worker_allreduce); the entry's default if unset.")
flags.DEFINE_list("gradient_compression", None,
                  "Gradient compressions to sweep for the strategies that take one "
                  "(allreduce*), of none,fp16,bf16; the entry's default if unset.")
flags.DEFINE_list("accumulation_steps", None,
                  "Accumulation steps to sweep for the strategies that take them (allreduce*), "
                  "e.g. 1,4; the entry's default if unset.")
flags.DEFINE_bool("communication_share", False,
                  "Also measure every configuration of tfpar's all-reduce step without its "
                  "all-reduce: the table's 'in step' column is then the communication's share "
                  "of a step in context (what overlap did not hide).")
flags.DEFINE_string("output", None, "Write the measurements to this JSON file.")
flags.DEFINE_string("csv", None, "Write the table to this CSV file.")
flags.DEFINE_string("plot", None, "Draw images/s and efficiency to this PNG file (matplotlib).")


def main(argv: list[str]) -> None:
    """Runs the benchmark and prints the table."""
    del argv  # run_main refuses positional arguments.
    unknown = [name for name in FLAGS.models if name not in models.available()]
    if unknown:
        raise ConfigError(f"Unknown model(s) {', '.join(unknown)}. Available models: "
                          f"{', '.join(models.available())}.")
    for name in FLAGS.strategies:
        strategies.entry(name)
    for path in (FLAGS.output, FLAGS.csv, FLAGS.plot):
        if path:
            atomic_io.check_writable(path)
    counts = [common.parse_count("--num_devices", n) for n in FLAGS.num_devices]
    for name, value, least in (("steps", FLAGS.steps, 2 * FLAGS.steps_per_execution),
                               ("rounds", FLAGS.rounds, 1),
                               ("warmup_steps", FLAGS.warmup_steps, 0),
                               ("profile_steps", FLAGS.profile_steps, 0),
                               ("steps_per_execution", FLAGS.steps_per_execution, 1),
                               ("threads_per_device", FLAGS.threads_per_device, 1)):
        if value is None:  # threads_per_device: the default.
            continue
        if value < least:
            raise ConfigError(f"--{name} must be at least {least}. Received: --{name}={value}.")
    if any(strategies.entry(name).multi_process for name in FLAGS.strategies):
        multi_worker_options.check_steps_per_execution(FLAGS.steps_per_execution)
    if FLAGS.batch_size < max(counts):
        raise ConfigError(f"--batch_size must be at least the largest device count "
                          f"({max(counts)}), so every replica gets an example. Received: "
                          f"--batch_size={FLAGS.batch_size}.")
    swept = {}
    if FLAGS.allreduce:
        for algorithm in FLAGS.allreduce:
            allreduce_options.check_algorithm(algorithm)
        swept["algorithm"] = FLAGS.allreduce
    if FLAGS.bytes_per_pack:
        swept["bytes_per_pack"] = [common.parse_count("--bytes_per_pack", n, least=0)
                                   for n in FLAGS.bytes_per_pack]
    if FLAGS.gradient_compression:
        for compression in FLAGS.gradient_compression:
            if compression not in allreduce_options.COMPRESSIONS:
                raise ConfigError(f"Unknown --gradient_compression {compression!r}. Allowed: "
                                  f"{', '.join(allreduce_options.COMPRESSIONS)}.")
        swept["gradient_compression"] = FLAGS.gradient_compression
    if FLAGS.accumulation_steps:
        swept["accumulation_steps"] = [common.parse_count("--accumulation_steps", n)
                                       for n in FLAGS.accumulation_steps]
    sweep = configuration.configurations(
        FLAGS.strategies, counts, FLAGS.models, FLAGS.batch_size, FLAGS.threads_per_device,
        baseline=FLAGS.baseline, ceiling=FLAGS.ceiling, strategy_options=swept,
        communication_share=FLAGS.communication_share, dtype=FLAGS.dtype,
        jit_compile=FLAGS.jit_compile, steps_per_execution=FLAGS.steps_per_execution,
        warmup_steps=FLAGS.warmup_steps)
    measurements = runner.run(sweep, steps=FLAGS.steps, rounds=FLAGS.rounds,
                                 profile_steps=FLAGS.profile_steps, profile_dir=FLAGS.profile_dir)
    print()
    print(f"Machine: {env.describe_cpu()}")  # Figures differ by CPU kind: say which.
    print(benchmark_report.table(measurements, FLAGS.epoch_examples))
    for path, write, what in ((FLAGS.output, benchmark_report.write_json, "Measurements"),
                              (FLAGS.csv, benchmark_report.write_csv, "Table"),
                              (FLAGS.plot, benchmark_report.plot, "Plot")):
        if path:
            write(path, measurements)
            print(f"{what} written to {path}")


def run() -> None:
    """Console-script entry point."""
    common.run_main(main, __name__)


if __name__ == "__main__":
    run()
