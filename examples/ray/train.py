"""LeNet on the digits under Ray Train with a tfpar multi-worker entry.

    pip install "tfpar-0.4.0-py3-none-any.whl[ray]"    # in a checkout: pip install -e ".[ray]"
    python train.py --num_workers=2 --epochs=5

On a laptop it starts a local Ray; on a Ray cluster (``--address=auto``, or submitted with
``ray job submit -- python examples/ray/train.py ...``) the same program runs there. Each
epoch's loss, accuracy and a checkpoint go to Ray; a worker that fails is restarted by Ray up
to ``--max_failures`` times, from the last checkpoint.
"""

import sys

from absl import app
from absl import flags

_STRATEGY = flags.DEFINE_enum("strategy", "multi_worker",
                              ["multi_worker", "multi_worker_allreduce"],
                              "tfpar entry each Ray worker trains under.")
_NUM_WORKERS = flags.DEFINE_string("num_workers", "2", "Ray workers (one process each): N, or "
                                   "MIN:MAX for an elastic job (Ray's ScalingConfig("
                                   "num_workers=(MIN, MAX))), which runs as many as the "
                                   "cluster's CPUs allow and restarts at the size left when a "
                                   "node is lost.")
_CPUS_PER_WORKER = flags.DEFINE_integer("cpus_per_worker", 1, "CPUs Ray gives each worker "
                                        "(its TensorFlow threads).", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 5, "Epochs.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Global batch size (all workers).",
                                   lower_bound=1)
_LR = flags.DEFINE_float("lr", 0.05, "SGD learning rate.", lower_bound=0.0)
_MAX_FAILURES = flags.DEFINE_integer("max_failures", 1, "Restarts Ray makes after a worker "
                                     "fails.", lower_bound=0)
_STORAGE_PATH = flags.DEFINE_string("storage_path", None, "Where Ray keeps checkpoints and "
                                    "results (default: ~/ray_results).")
_ADDRESS = flags.DEFINE_string("address", None, "Ray cluster to join ('auto': the one this "
                               "machine belongs to; default: start a local Ray).")


# --8<-- [start:loop]
def train_loop_per_worker(config: dict) -> None:
    """What every Ray worker runs: a plain Keras program under a tfpar entry."""
    # tfpar first: it chooses TensorFlow's CPU kernels before TensorFlow starts.
    import tfpar  # noqa: I001
    import keras

    strategy = tfpar.strategies.get(config["strategy"])  # The cluster: Ray's TF_CONFIG.
    splits = tfpar.data.load("digits")
    with strategy.scope():
        model = tfpar.models.lenet()
        model.compile(optimizer=keras.optimizers.SGD(config["lr"], momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    report = tfpar.ray.ReportCheckpointCallback(model, strategy)
    model.fit(tfpar.data.pipeline(splits.train, config["batch_size"], shuffle=True),
              validation_data=tfpar.data.pipeline(splits.test, config["batch_size"]),
              epochs=config["epochs"], initial_epoch=report.restore(), callbacks=[report],
              verbose=2)
# --8<-- [end:loop]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments: {' '.join(argv[1:])}. Everything is a --flag.")
    try:
        import tfpar.ray  # noqa: F401  (names the extra that brings Ray Train)
    except ImportError as e:
        sys.exit(str(e))
    import ray
    from ray.train import FailureConfig
    from ray.train import RunConfig
    from ray.train import ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    from tfpar.cluster import elastic
    from tfpar.errors import ConfigError

    try:
        fewest, most = elastic.parse_worker_range(_NUM_WORKERS.value)
    except ConfigError as e:
        sys.exit(f"Error: {e.render(lambda name: f'--{name}')}")
    ray.init(address=_ADDRESS.value, include_dashboard=False)
    # --8<-- [start:trainer]
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"strategy": _STRATEGY.value, "epochs": _EPOCHS.value,
                           "batch_size": _BATCH_SIZE.value, "lr": _LR.value},
        scaling_config=ScalingConfig(num_workers=most if fewest == most else (fewest, most),
                                     resources_per_worker={"CPU": _CPUS_PER_WORKER.value}),
        run_config=RunConfig(storage_path=_STORAGE_PATH.value,
                             failure_config=FailureConfig(max_failures=_MAX_FAILURES.value)))
    result = trainer.fit()
    # --8<-- [end:trainer]
    metrics = result.metrics
    print(f"test acc: {metrics['val_accuracy']:.4f} after {metrics['epoch']} epochs on "
          f"{_NUM_WORKERS.value} Ray workers ({_STRATEGY.value}); checkpoint: "
          f"{result.checkpoint.path}")


if __name__ == "__main__":
    app.run(main)
