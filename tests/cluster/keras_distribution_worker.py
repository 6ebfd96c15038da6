"""A worker of a two-process job that trains through ``keras.distribution`` (or, to compare,
through the tfpar entry itself); the chief saves the weights.

Usage (through the launcher): keras_distribution_worker.py keras|keras_own|keras_own_virtual|entry
LOCAL_DEVICES OUTPUT.npz (``keras_own``: each process reads its own share of the data, every
other example, under ``DataParallel(auto_shard_dataset=False)``, and tries to set a second
distribution that shards; it only fits; ``keras_own_virtual`` the same with
``virtual_replicas=4``; ``keras_own_uneven``: process 1's own input gives one batch more)
(LOCAL_DEVICES ``uneven``: two for the first worker, one for the others.)
"""

import json
import os
import sys

import numpy as np

import tfpar
from tfpar import devices


def main(path: str, local_devices: int, output: str) -> None:
    if local_devices == -1:
        local_devices = 2 if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0 else 1
    devices.ensure_logical_cpus(local_devices)
    import keras  # noqa: PLC0415 (after the CPU is split)

    from tfpar.cluster.spec import is_chief  # noqa: PLC0415

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    from keras_distribution_test import build  # noqa: PLC0415
    from keras_distribution_test import data  # noqa: PLC0415

    if path == "keras_own_uneven":  # Process 1's input gives one batch more.
        tfpar.keras_distribution.install()
        keras.distribution.initialize()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False))
        model = build()
        _, index = tfpar.keras_distribution.processes()
        model.fit(data().take(2 + index), epochs=1, verbose=0)
        return
    if path in ("keras_own", "keras_own_virtual"):
        tfpar.keras_distribution.install(
            **({"virtual_replicas": 4} if path == "keras_own_virtual" else {}))
        keras.distribution.initialize()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False))
        try:  # A second distribution that reads the input the other way.
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        except tfpar.errors.ConfigError as e:
            print("refused:", e, flush=True)
        model = build()
        _, index = tfpar.keras_distribution.processes()
        # Each process's batch of 4 is its share of a global batch of 8.
        model.fit(data().unbatch().shard(2, index).batch(4), epochs=2, verbose=0)
        if is_chief(model.distribute_strategy):
            np.savez(output, *[np.asarray(v) for v in model.trainable_variables])
        return
    if path == "keras":
        tfpar.keras_distribution.install()
        keras.distribution.initialize()
        print("devices", " ".join(keras.distribution.list_devices()), flush=True)
        # TensorFlow's names of the same devices are the same mesh.
        tensorflow_names = [f"/device:{name.upper()}" for name in
                            keras.distribution.list_devices()]
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=tensorflow_names))
        print("set by", tensorflow_names[0], flush=True)
        # Set through fit, evaluate and predict, as the guide has it.
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = build()
        strategy = model.distribute_strategy
    else:
        strategy = tfpar.strategies.get("multi_worker_allreduce", local_devices)
        with strategy.scope():
            model = build()
    print("entry", tfpar.strategies.selection(strategy).name, strategy.num_replicas_in_sync,
          flush=True)
    model.fit(data(), epochs=2, verbose=0)
    x = np.concatenate([batch for batch, _ in data().as_numpy_iterator()])
    evaluated = model.evaluate(data(), verbose=0)
    predicted = model.predict(x, verbose=0)
    if is_chief(strategy):
        np.savez(output, *[np.asarray(v) for v in model.trainable_variables],
                 np.float64(evaluated), predicted)


if __name__ == "__main__":
    main(sys.argv[1], -1 if sys.argv[2] == "uneven" else int(sys.argv[2]), sys.argv[3])
