"""One process of a world-size-invariant job (``virtual_replicas``), alone or under the launcher.

``python virtual_replicas_worker.py LOCAL_DEVICES VIRTUAL STATE OUTPUT [STOP_AT|kill|- [keras]]``:
trains the
exactness matrix's users' functional model (BatchNorm, Dropout, Adam with EMA and a schedule)
on LOCAL_DEVICES logical CPU devices of one thread each, under ``multi_worker_allreduce`` when
the launcher gave it a ``TF_CONFIG``, else ``allreduce``, with ``virtual_replicas=VIRTUAL``,
resuming from STATE (:class:`~tfpar.callbacks.EpochCheckpoint`). With STOP_AT ``E:S``, worker 0
sends itself a preemption notice after step S of epoch E (the job saves and exits 85); with
``kill``, the worker in slot 2 kills itself once the optimizer made 8 steps, the first time only
(an elastic launcher loses it); ``-``: neither. With ``keras``, the model is built under
``keras.distribution.DataParallel()`` through :mod:`tfpar.keras_distribution` instead. Each
process writes every variable of its model and optimizer, each local replica's copy, to
``OUTPUT.RANK.npz``.
"""

import json
import os
import sys

from tfpar import devices

devices.ensure_logical_cpus(int(sys.argv[1]), threads_per_device=1)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "end_to_end"))

import exactness_test  # noqa: E402  (after the path it lives on)

import tfpar  # noqa: E402
from tfpar.callbacks import EpochCheckpoint  # noqa: E402
from tfpar.callbacks import SaveOnPreemption  # noqa: E402


def main(local: str, virtual: str, state: str, output: str, stop_at: str = "",
         api: str = "entry") -> None:
    import keras

    config = os.environ.get("TF_CONFIG")
    rank = json.loads(config)["task"]["index"] if config else 0
    keras.utils.set_random_seed(1)
    if api == "keras":  # Keras's own API, the entry and its options named once.
        tfpar.keras_distribution.install("allreduce", virtual_replicas=int(virtual))
        keras.distribution.initialize()
        distribution = keras.distribution.DataParallel()
    else:
        entry = "multi_worker_allreduce" if config else "allreduce"
        distribution = tfpar.strategies.get(entry, int(local), virtual_replicas=int(virtual))
    with distribution.scope():
        model = exactness_test.users_functional()
    strategy = model.distribute_strategy
    x, y = exactness_test.examples()
    checkpoint = EpochCheckpoint(state, model, strategy)
    initial_epoch = checkpoint.restore()
    callbacks: list = [checkpoint, SaveOnPreemption(checkpoint)]
    stop_at = "" if stop_at == "-" else stop_at
    if stop_at == "kill" and os.environ.get("TFPAR_WORKER_SLOT") == "2":
        sys.path.insert(0, HERE)
        from exactness_worker import KillOnce

        callbacks.append(KillOnce(f"{state}.killed"))
    elif stop_at and stop_at != "kill" and rank == 0:
        epoch, step = (int(n) for n in stop_at.split(":"))
        callbacks.append(exactness_test.SignalAt(epoch, step))
    model.fit(x, y, batch_size=exactness_test.BATCH, epochs=exactness_test.EPOCHS,
              shuffle=False, verbose=0, initial_epoch=initial_epoch, callbacks=callbacks)
    values = {}
    for place, variable in enumerate([*model.variables, *model.optimizer.variables]):
        tensor = getattr(variable, "value", variable)
        for replica, copy in enumerate(getattr(tensor, "values", (tensor,))):
            values[f"{place:03d} {replica} {variable.path}"] = copy.numpy()
    np.savez(f"{output}.{rank}.npz", **values)


if __name__ == "__main__":
    main(*(arg for arg in sys.argv[1:] if not arg.startswith("--")))  # The launcher reads --flags.
