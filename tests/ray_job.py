"""A Ray Train job for ray_test: a user's train loop under TensorflowTrainer on a local Ray.

``python ray_job.py INITIAL.npz OUTDIR``: starts Ray (2 CPUs) and runs eight trainers of 2
workers: ``multi_worker``, ``multi_worker_allreduce``, and two ``multi_worker`` jobs whose
worker 1 gets a signal at the start of epoch 2 of its first attempt, once Ray's controller has
collected the epoch-1 checkpoint (it polls the workers every 2 s): ``killed`` (signal 9,
restarted by Ray, ``FailureConfig(max_failures=1)``) and ``terminated`` (SIGTERM, as a
scheduler's first notice); then a model with BatchNorm reporting a state every step,
uninterrupted (``batchnorm``) and killed after epoch 2's second step
(``batchnorm_killed_mid_epoch``); then the guide's ``keras.distribution.DataParallel`` through
tfpar, uninterrupted and killed as ``killed`` is (``keras_distribution``,
``keras_distribution_killed``). Each writes OUTDIR/NAME.json (the Result's metrics, its
checkpoint's folder, the epoch each attempt started at) and OUTDIR/NAME.npz (the final weights).
Run it in a private network namespace: Ray then puts 127.0.0.1 in TF_CONFIG.
"""

import json
import os
import sys
import time

import numpy as np
import ray
from ray.train import FailureConfig
from ray.train import RunConfig
from ray.train import ScalingConfig
from ray.train.tensorflow import TensorflowTrainer

EPOCHS = 3


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(48, 13)).astype("float32"),
            rng.normal(size=(48, 6)).astype("float32"))


def user_model(batchnorm: bool = False):
    import keras

    model = keras.Sequential([keras.Input((13,)), keras.layers.Dense(8, activation="relu"),
                              *([keras.layers.BatchNormalization()] if batchnorm else []),
                              keras.layers.Dense(6)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def train_loop_per_worker(config):
    import keras
    import tensorflow as tf

    import tfpar

    if config["entry"] == "keras_distribution":  # Keras's own API, the guide's code.
        tfpar.keras_distribution.install()
        keras.distribution.initialize()
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = user_model()
        strategy = model.distribute_strategy
    else:
        strategy = tfpar.strategies.get(config["entry"])
        with strategy.scope():
            model = user_model(config["every"] is not None)
    if config["every"] is None:
        model.set_weights(list(np.load(config["initial"]).values()))
    else:  # Each replica's own BatchNorm statistics, reported every step too.
        keras.utils.set_random_seed(0)
        model.set_weights([np.asarray(w) for w in user_model(True).get_weights()])
    report = tfpar.ray.ReportCheckpointCallback(model, strategy,
                                                save_every_steps=config["every"])
    initial_epoch = report.restore()
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"{config['name']}.starts"), "a") as f:
        f.write(f"{rank} {initial_epoch}\n")

    class KillOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if not config["every"]:
                self.kill()

        def on_train_batch_end(self, batch, logs=None):
            if config["every"] and batch == 1:  # After the report of epoch 2's second step.
                self.kill()

        def kill(self):
            marker = os.path.join(config["out"], f"{config['name']}.signalled")
            if config["kill"] and rank == 1 and self.epoch == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(5)  # Ray's controller collects reports every 2 s.
                os.kill(os.getpid(), config["kill"])
                time.sleep(5)  # A signal the process survives lets it train on.

    if rank == 0 and config["name"] == "multi_worker":
        record_keras_versions(os.path.join(config["out"], "keras_versions.json"))
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(dataset, epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0,
              callbacks=[report, KillOnce()])
    if rank == 0:
        np.savez(os.path.join(config["out"], f"{config['name']}.npz"), *model.get_weights())


def record_keras_versions(path: str) -> None:
    """Writes which package tf.keras is in a Ray worker, in a process it starts, and in a worker
    of tfpar's launcher it starts (Ray sets TF_USE_LEGACY_KERAS=1 in its workers)."""
    import io
    import subprocess

    import tensorflow as tf

    from tfpar.cluster import launcher

    # The package tf.keras's classes come from: keras (Keras 3) or tf_keras (Keras 2).
    code = "import tensorflow as tf; print('tf.keras', tf.keras.Model.__module__.split('.')[0])"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    launched = io.StringIO()
    launcher.launch([sys.executable, "-c", code], 1, out=launched)
    with open(path, "w") as f:
        json.dump({"switch": os.environ.get("TF_USE_LEGACY_KERAS"),
                   "worker": tf.keras.Model.__module__.split(".")[0],
                   "started_process": plain.stdout.split("tf.keras ")[-1].strip(),
                   "launcher_worker": launched.getvalue().split("tf.keras ")[-1].strip(),
                   "launcher_said": launched.getvalue().splitlines()[0]}, f)


def main(initial: str, out: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    for name, entry, kill, every in (
            ("multi_worker", "multi_worker", 0, None),
            ("multi_worker_allreduce", "multi_worker_allreduce", 0, None),
            ("killed", "multi_worker", 9, None),
            ("terminated", "multi_worker", 15, None),
            # A BatchNorm model reporting every step; killed after epoch 2's second step.
            ("batchnorm", "multi_worker_allreduce", 0, 1),
            ("batchnorm_killed_mid_epoch", "multi_worker_allreduce", 9, 1),
            # keras.distribution.DataParallel through tfpar, uninterrupted and killed.
            ("keras_distribution", "keras_distribution", 0, None),
            ("keras_distribution_killed", "keras_distribution", 9, None)):
        trainer = TensorflowTrainer(
            train_loop_per_worker,
            train_loop_config={"entry": entry, "initial": initial, "out": out, "name": name,
                               "kill": kill, "every": every},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=os.path.join(out, "store"), name=name,
                                 failure_config=FailureConfig(max_failures=1 if kill else 0)))
        result = trainer.fit()
        with open(os.path.join(out, f"{name}.starts")) as f:
            starts = sorted(f.read().split("\n")[:-1])
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({"metrics": result.metrics, "checkpoint": result.checkpoint.path,
                       "error": repr(result.error) if result.error else None,
                       "starts": starts}, f)
        print(f"ray_job: {name} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
