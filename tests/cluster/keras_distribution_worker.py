"""A worker of a two-process job that trains through ``keras.distribution`` (or, to compare,
through the tfpar entry itself); the chief saves the weights.

Usage (through the launcher): keras_distribution_worker.py keras|entry LOCAL_DEVICES OUTPUT.npz
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

    if path == "keras":
        tfpar.keras_distribution.install()
        keras.distribution.initialize()
        print("devices", " ".join(keras.distribution.list_devices()), flush=True)
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
