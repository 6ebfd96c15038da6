"""``tfpar-benchmark``: images/s of strategies x device counts x models, side by side.

Example::

    tfpar-benchmark --strategies=mirrored,allreduce,multi_worker \\
        --num_devices=1,2 --models=lenet --baseline
"""

from __future__ import annotations

from absl import flags

from tfpar import atomic_io
from tfpar import env
from tfpar import strategies
from tfpar.allreduce.options import StepOptions
from tfpar.benchmark import measurements as benchmark_measurements
from tfpar.benchmark import report as benchmark_report
from tfpar.benchmark import runner
from tfpar.benchmark import tuning
from tfpar.benchmark.config import BenchmarkConfig
from tfpar.cli import common
from tfpar.cli import config_flags
from tfpar.training.config import AUTO

FLAGS = flags.FLAGS

# Every field of the benchmark's configuration is a flag, and every option of the all-reduce
# step a flag of values to sweep (types, defaults, help and choices from the classes).
config_flags.define(BenchmarkConfig, exclude=("strategy_options",))
_NOT_SWEPT = ("split_weights",)  # Per-device shares depend on the device count.
config_flags.define_sweep(StepOptions, exclude=_NOT_SWEPT)
flags.DEFINE_string("output", None, "Write the measurements to this JSON file.")
flags.DEFINE_string("csv", None, "Write the table to this CSV file.")
flags.DEFINE_string("plot", None, "Draw images/s and efficiency to this PNG file (matplotlib).")


def main(argv: list[str]) -> None:
    """Runs the benchmark and prints the table."""
    del argv  # run_main refuses positional arguments.
    config = BenchmarkConfig(
        **config_flags.values(BenchmarkConfig, exclude=("strategy_options",)),
        strategy_options=config_flags.sweep_values(StepOptions, exclude=_NOT_SWEPT))
    for path in (FLAGS.output, FLAGS.csv, FLAGS.plot):
        if path:
            atomic_io.check_writable(path)
    if config.tune:
        _tune(config)
        return
    sweep = benchmark_measurements.configurations(
        config.strategies, config.num_devices, config.models, config.batch_size,
        config.threads_per_device, baseline=config.baseline, ceiling=config.ceiling,
        strategy_options=config.strategy_options,
        communication_share=config.communication_share,
        dtype="float32" if config.dtype == AUTO else config.dtype,
        jit_compile=config.jit_compile,
        steps_per_execution=(1 if config.steps_per_execution == AUTO
                             else config.steps_per_execution),
        warmup_steps=config.warmup_steps)
    if AUTO in (config.dtype, config.steps_per_execution):
        sweep, said = benchmark_measurements.chosen_for_the_machine(
            sweep, dtype=config.dtype == AUTO,
            steps_per_execution=config.steps_per_execution == AUTO)
        print("\n".join(said), flush=True)
    measurements = runner.run(sweep, steps=config.steps, rounds=config.rounds,
                              profile_steps=config.profile_steps,
                              profile_dir=config.profile_dir)
    print()
    print(f"Machine: {env.describe_cpu()}")  # Figures differ by CPU kind: say which.
    print(benchmark_report.table(measurements, config.epoch_examples))
    for line in benchmark_report.scaling_lines(measurements):
        print(line)
    for path, write, what in ((FLAGS.output, benchmark_report.write_json, "Measurements"),
                              (FLAGS.csv, benchmark_report.write_csv, "Table"),
                              (FLAGS.plot, benchmark_report.plot, "Plot")):
        if path:
            write(path, measurements)
            print(f"{what} written to {path}")


def _tune(config: BenchmarkConfig) -> None:
    """Times the thread layouts of each device count above 1 and stores the fastest."""
    print(f"Machine: {env.describe_cpu()}")
    for count in sorted(n for n in set(config.num_devices) if n > 1):
        base = benchmark_measurements.Configuration(
            strategies.choose(config.strategies[0]), count, config.models[0], config.batch_size,
            dtype=config.dtype, jit_compile=config.jit_compile,
            steps_per_execution=int(config.steps_per_execution),
            warmup_steps=config.warmup_steps)
        print("\n".join(tuning.tune(base, config.steps, config.rounds).lines()), flush=True)


def run() -> None:
    """Console-script entry point."""
    common.run_main(main, __name__, aliases=config_flags.flag_names(StepOptions))


if __name__ == "__main__":
    run()
