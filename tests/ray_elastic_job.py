"""An elastic Ray Train job for ray_test: a node leaves, Ray shrinks the tfpar job, it resumes.

``python ray_elastic_job.py INITIAL.npz OUTDIR``: a local Ray cluster of three nodes on this
machine (ray.cluster_utils.Cluster: a head with no CPU, a node of 2 CPUs and one of 1 CPU) runs
``TensorflowTrainer`` with ``ScalingConfig(num_workers=(2, 3))``: Ray starts 3 workers. Once the
epoch-1 checkpoint is reported, the 1-CPU node is removed (its worker dies with it); Ray
restarts the group at the 2 workers the cluster still has room for, and tfpar's
ReportCheckpointCallback restores the checkpoint. Writes OUTDIR/elastic.json (the Result's
metrics and error, the (workers, epoch) each attempt started at) and OUTDIR/elastic.npz (the
final weights). Run it in a private network namespace.
"""

import json
import os
import sys
import threading
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster
from ray.train import FailureConfig
from ray.train import RunConfig
from ray.train import ScalingConfig
from ray.train.tensorflow import TensorflowTrainer
from ray_job import EPOCHS
from ray_job import data
from ray_job import user_model


def train_loop_per_worker(config):
    import keras
    import tensorflow as tf

    import tfpar

    strategy = tfpar.strategies.get("multi_worker_allreduce")
    with strategy.scope():
        model = user_model()
    model.set_weights(list(np.load(config["initial"]).values()))
    report = tfpar.ray.ReportCheckpointCallback(model, strategy)
    initial_epoch = report.restore()
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    if rank == 0:
        with open(os.path.join(config["out"], "elastic.starts"), "a") as f:
            f.write(f"{size} {initial_epoch}\n")

    class SlowFirstAttempt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if size == 3 and epoch == 1:
                if rank == 0:  # Epoch 1's checkpoint is reported: the node may go.
                    open(os.path.join(config["out"], "elastic.epoch1"), "w").close()
                time.sleep(60)  # Until the node is gone and Ray stops this attempt.

    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(dataset, epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0,
              callbacks=[report, SlowFirstAttempt()])
    if rank == 0:
        np.savez(os.path.join(config["out"], "elastic.npz"), *model.get_weights())


def main(initial: str, out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=2)
    leaving = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True)
    trainer = TensorflowTrainer(
        train_loop_per_worker, train_loop_config={"initial": initial, "out": out},
        scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.join(out, "store"), name="elastic",
                             failure_config=FailureConfig(max_failures=2)))

    def remove_the_node():
        marker = os.path.join(out, "elastic.epoch1")
        while not os.path.exists(marker):
            time.sleep(0.5)
        time.sleep(4)  # Ray's controller collects the reported checkpoint every 2 s.
        cluster.remove_node(leaving, allow_graceful=False)
        print("ray_elastic_job: the 1-CPU node left", flush=True)

    threading.Thread(target=remove_the_node, daemon=True).start()
    result = trainer.fit()
    with open(os.path.join(out, "elastic.starts")) as f:
        starts = f.read().split("\n")[:-1]
    with open(os.path.join(out, "elastic.json"), "w") as f:
        json.dump({"metrics": result.metrics,
                   "error": repr(result.error) if result.error else None,
                   "starts": starts}, f)
    print("ray_elastic_job: done", flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
