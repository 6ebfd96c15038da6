"""``scripts/benchmark_workers.py`` and its workers: multi-worker scaling, one core per worker.

    python scripts/benchmark_workers.py --model=resnet18 --workers=1,2 --rounds=3

Run without ``--workers`` (as the launcher does, with ``TF_CONFIG`` set) it is one worker.
"""

from __future__ import annotations

from absl import app
from absl import flags

from tfpar import worker_benchmark
from tfpar.cli import common

FLAGS = flags.FLAGS

flags.DEFINE_string("model", "resnet18", "Model to train.")
flags.DEFINE_list("workers", None, "Worker counts to compare, e.g. 1,2 (unset: be one worker).")
flags.DEFINE_integer("batch_per_worker", 32, "Examples per worker and step.")
flags.DEFINE_integer("steps", 6, "Timed steps per round.")
flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first (tracing).")
flags.DEFINE_integer("rounds", 3, "Rounds per worker count (alternating).")
flags.DEFINE_integer("inter_op_threads", 1, "Inter-op threads per worker (intra-op is 1).")


def main(argv: list[str]) -> None:
    """Compares worker counts, or runs as one worker when ``--workers`` is unset."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.workers:
        worker_benchmark.run_worker(FLAGS.model, FLAGS.batch_per_worker, FLAGS.steps,
                                    FLAGS.warmup_steps, FLAGS.inter_op_threads)
        return
    counts = [common.parse_count("--workers", w) for w in FLAGS.workers]
    results = worker_benchmark.measure(counts, FLAGS.model, FLAGS.batch_per_worker, FLAGS.steps,
                                       FLAGS.warmup_steps, FLAGS.rounds,
                                       FLAGS.inter_op_threads)
    base = results[0]
    print(f"\n{FLAGS.model}, {FLAGS.batch_per_worker} images per worker and step, one core per "
          "worker:")
    for r in results:
        print(f"  {r.num_workers} worker(s): {r.best:.1f} images/s (best of "
              f"{[round(x, 1) for x in r.images_per_second]}), "
              f"{r.best / base.best:.2f}x {base.num_workers} worker(s)")


def run() -> None:
    """Console-script entry point."""
    common.run_main(main, __name__)


if __name__ == "__main__":
    run()
