"""``scripts/benchmark.py``: images/s of strategies x device sets x models, side by side.

Example::

    python scripts/benchmark.py --strategies=mirrored,allreduce --num_devices=1,2 \\
        --models=lenet,resnet18 --baseline
"""

from __future__ import annotations

from absl import app
from absl import flags

from tfpar import atomic_io
from tfpar import benchmark
from tfpar import models
from tfpar import strategies
from tfpar import training
from tfpar.cli import common
from tfpar.errors import ConfigError

FLAGS = flags.FLAGS

flags.DEFINE_list("strategies", ["mirrored", "allreduce"], "Registry strategies to compare.")
flags.DEFINE_list("num_devices", ["1", "2"], "Device-set sizes.")
flags.DEFINE_list("models", ["lenet"], f"Models, of {', '.join(models.available())}.")
flags.DEFINE_integer("batch_size", 256, "Global batch size.")
flags.DEFINE_integer("steps", 10, "Training steps per measured round.")
flags.DEFINE_integer("warmup_rounds", 1, "Unmeasured rounds before measuring.")
flags.DEFINE_integer("rounds", 5, "Measured rounds (interleaved across configurations).")
flags.DEFINE_integer("epoch_examples", 60_000, "Epoch size for the sec/epoch column.")
flags.DEFINE_enum("dtype", "float32", list(training.DTYPES),
                  "Keras dtype policy of the models.")
flags.DEFINE_bool("baseline", False, "Also measure plain Keras with no strategy on one device.")
flags.DEFINE_string("output", None, "Write the measurements to this JSON file.")
flags.DEFINE_string("csv", None, "Write the table to this CSV file.")
flags.DEFINE_string("plot", None, "Draw images/s and efficiency to this PNG file (matplotlib).")


def main(argv: list[str]) -> None:
    """Runs the benchmark and prints the table."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    unknown = [name for name in FLAGS.models if name not in models.available()]
    if unknown:
        raise ConfigError(f"Unknown model(s) {', '.join(unknown)}. Available models: "
                          f"{', '.join(models.available())}.")
    for name in FLAGS.strategies:
        strategies.entry(name)
    for path in (FLAGS.output, FLAGS.csv, FLAGS.plot):
        if path:
            atomic_io.check_writable(path)
    device_sets = [common.parse_count("--num_devices", n) for n in FLAGS.num_devices]
    measurements = benchmark.run(FLAGS.strategies, device_sets, FLAGS.models,
                                 FLAGS.batch_size, steps=FLAGS.steps,
                                 warmup_rounds=FLAGS.warmup_rounds, rounds=FLAGS.rounds,
                                 baseline=FLAGS.baseline, dtype=FLAGS.dtype)
    print()
    print(benchmark.table(measurements, FLAGS.epoch_examples))
    if FLAGS.output:
        atomic_io.write_json(FLAGS.output, [dict(vars(m), best=m.best, median=m.median,
                                                 spread=m.spread) for m in measurements])
        print(f"Measurements written to {FLAGS.output}")
    if FLAGS.csv:
        benchmark.write_csv(FLAGS.csv, measurements)
        print(f"Table written to {FLAGS.csv}")
    if FLAGS.plot:
        benchmark.plot(FLAGS.plot, measurements)
        print(f"Plot written to {FLAGS.plot}")


def run() -> None:
    """Console-script entry point."""
    common.run_main(main, __name__)


if __name__ == "__main__":
    run()
