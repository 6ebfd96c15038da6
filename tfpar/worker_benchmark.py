"""Multi-worker throughput: N local worker processes of one core each against one worker.

Each measurement launches the workers with :mod:`tfpar.launcher` (``MultiWorkerMirroredStrategy``
over loopback gRPC), every worker pinned to one intra-op and one inter-op thread so that a
worker is one core. A worker trains warm-up steps, then times ``steps`` steps on synthetic
data with a global batch of ``batch_per_worker`` times the number of workers; worker 0 prints
the images/s. Rounds alternate the worker counts (1, 2, 1, 2, ...) and the best round of each
count is compared, as in :mod:`tfpar.benchmark`.
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import time
from typing import Callable, Optional, Sequence

from tfpar import launcher

_RESULT = re.compile(r"^\[worker 0\] IMAGES_PER_SECOND=([0-9.]+)$", re.MULTILINE)


def run_worker(model_name: str, batch_per_worker: int, steps: int, warmup_steps: int,
               inter_op_threads: int = 1) -> None:
    """One worker's part (run under the launcher): prints ``IMAGES_PER_SECOND=`` on worker 0."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar import cluster
    from tfpar import models
    from tfpar import strategies

    # One core of compute per worker; must come before TensorFlow initialises. More inter-op
    # threads let the collective's communication run beside the compute.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    strategy = strategies.get("multi_worker", 1)
    global_batch = batch_per_worker * strategy.num_replicas_in_sync
    with strategy.scope():
        model = models.build(model_name, num_classes=10, input_shape=(28, 28, 1))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    batch = (rng.random((global_batch, 28, 28, 1), dtype=np.float32),
             rng.integers(0, 10, global_batch).astype(np.int32))
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    model.fit(dataset, steps_per_epoch=warmup_steps, verbose=0)
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    if cluster.is_chief(strategy):
        print(f"IMAGES_PER_SECOND={steps * global_batch / seconds:.3f}", flush=True)


@dataclasses.dataclass
class WorkerMeasurement:
    """Images/s of one worker count over the rounds."""

    num_workers: int
    images_per_second: list[float] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> float:
        """Best round."""
        return max(self.images_per_second)


def measure(worker_counts: Sequence[int], model_name: str, batch_per_worker: int, steps: int,
            warmup_steps: int, rounds: int, inter_op_threads: int = 1,
            progress: Optional[Callable[[str], None]] = print) -> list[WorkerMeasurement]:
    """Launches every worker count ``rounds`` times, alternating; returns the measurements.

    Raises:
        RuntimeError: If a launch fails (its output is in the message).
    """
    results = [WorkerMeasurement(n) for n in worker_counts]
    command = [sys.executable, "-m", "tfpar.cli.worker_benchmark", f"--model={model_name}",
               f"--batch_per_worker={batch_per_worker}", f"--steps={steps}",
               f"--warmup_steps={warmup_steps}", f"--inter_op_threads={inter_op_threads}"]
    for round_index in range(rounds):
        for result in results:
            out = io.StringIO()
            status = launcher.launch(command, result.num_workers, out=out)
            match = _RESULT.search(out.getvalue())
            if status != 0 or not match:
                raise RuntimeError(f"{result.num_workers} worker(s) failed (status {status}):\n"
                                   f"{out.getvalue()[-3000:]}")
            result.images_per_second.append(float(match.group(1)))
            if progress:
                progress(f"round {round_index + 1}/{rounds}: {result.num_workers} worker(s) "
                         f"{result.images_per_second[-1]:.1f} images/s")
    return results
