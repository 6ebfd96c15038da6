"""One benchmark configuration in a process of its own, measured slice by slice on request.

Thread settings are fixed per process when TensorFlow initialises, so :mod:`tfpar.benchmark.runner`
runs every configuration (1 device on 1 core, 2 devices, plain Keras on all cores, each
worker of a multi-worker job) as a long-lived process of this module. It builds the model,
warms up, prints ``READY {json}`` (with ``first_step_at``: when its first compiled call ended,
on the wall clock) and then serves requests on stdin:

- ``RUN k``: train ``k`` steps, print ``DONE {seconds} {steps} {all_reduce_seconds}``: the
  time from the end of the first compiled call to the end of the last one and the steps in
  between (so start-up costs of the call are not in the figure), then the time of one
  all-reduce of the model's gradient shapes through the strategy, timed alone (one function
  call: what a step spends communicating, give or take a fraction of a millisecond);
- end of input: exit.

A configuration that cannot run (e.g. XLA on several CPU replicas) answers ``ERROR {json}``
(the error's message and argument) instead of ``READY`` and exits with status 2.

Run as ``python -m tfpar.benchmark.worker '{json of a Configuration}' [PROFILE_STEPS DIR]``;
with the last two it traces that many steps for TensorBoard's profiler after warm-up (outside
every measurement).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import keras
import numpy as np
import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.allreduce import algorithms
from tfpar.benchmark import flops
from tfpar.benchmark.measurements import Ceiling
from tfpar.benchmark.measurements import Configuration
from tfpar.benchmark.measurements import PlainKeras
from tfpar.callbacks.profiling import ProfileSteps
from tfpar.cluster import spec as cluster_spec
from tfpar.errors import TfparError
from tfpar.host import thread_layouts
from tfpar.training import building

# Every configuration trains SGD with momentum (the train command's default optimizer) at one
# small rate that no configuration's batch diverges with; the rate does not change the speed.
LEARNING_RATE, MOMENTUM = 0.01, 0.9


class _StepTimes(keras.callbacks.Callback):
    """The time at the end of every compiled call, with its step index."""

    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((time.perf_counter(), batch))


class _Trainer:
    """One configuration, built: trains ``k`` steps, and times one step's all-reduce alone."""

    def __init__(self, config: Configuration):
        """Sets threads and devices (before TensorFlow initialises), then builds everything."""
        self.config = config
        if isinstance(config.strategy, Ceiling):  # One of several plain processes.
            devices_lib.ensure_logical_cpus(1, config.threads_per_device)
            self.strategy = tf.distribute.get_strategy()
            devices = [f"process:{i}/CPU:0" for i in range(config.num_devices)]
        elif isinstance(config.strategy, PlainKeras):
            self.strategy = tf.distribute.get_strategy()
            devices = ["CPU:0"]
        else:
            local_devices = config.num_devices // config.num_processes
            if local_devices > 1:  # Read by TensorFlow when it starts: set before it does.
                thread_layouts.use_pools(config.thread_layout, replace=True)
            devices_lib.ensure_logical_cpus(local_devices, layout=config.thread_layout)
            device_set = devices_lib.resolve(local_devices)
            self.strategy = config.strategy.build(device_set)
            if not config.communication:  # Traced (at the first step) without the all-reduce.
                self._no_communication = algorithms.without_communication()
                self._no_communication.__enter__()
            devices = building.replica_devices(self.strategy, device_set)
            building.check_compile_options(config.jit_compile, self.strategy, device_set)
        self.model = building.build_compiled_model(
            config.model, config.image_shape, 10, self.strategy,
            lambda: keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM), dtype=config.dtype,
            jit_compile=config.jit_compile, steps_per_execution=config.steps_per_execution)
        # An independent process trains one replica's share of the global batch.
        batch = (config.batch_size // config.num_devices
                 if isinstance(config.strategy, Ceiling) else config.step_batch_size)
        rng = np.random.default_rng(0)
        images = rng.random((batch, *config.image_shape), dtype=np.float32)
        labels = rng.integers(0, 10, batch).astype(np.int32)
        # One cached batch repeated: the benchmark measures training, not input decoding.
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        self.dataset = (tf.data.Dataset.from_tensors((images, labels)).repeat()
                        .with_options(options).prefetch(tf.data.AUTOTUNE))
        self.timer = _StepTimes()
        self.info = {"devices": devices,
                     "training_flops_per_image": flops.training_flops_per_image(self.model),
                     "gradient_bytes": sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                                           for v in self.model.trainable_variables)}
        self._all_reduce = tf.function(self._all_reduce_gradient_shapes)

    def train(self, steps: int, callbacks: Sequence[keras.callbacks.Callback] = ()
              ) -> tuple[float, int]:
        """Trains ``steps`` steps; returns seconds and steps from the first call's end on."""
        self.model.fit(self.dataset, steps_per_epoch=steps, shuffle=False,
                       callbacks=[self.timer, *callbacks],
                       verbose=0)
        (first, first_step), (last, last_step) = self.timer.ends[0], self.timer.ends[-1]
        return last - first, last_step - first_step

    def _all_reduce_gradient_shapes(self) -> tf.Tensor:
        def replica_fn():
            gradients = [tf.ones(v.shape, v.dtype) for v in self.model.trainable_variables]
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, gradients)
            return reduced[0][(0,) * reduced[0].shape.rank]

        return self.strategy.experimental_local_results(self.strategy.run(replica_fn))[0]

    def all_reduce_seconds(self) -> float:
        """Seconds of one all-reduce of gradient-shaped tensors through the strategy alone
        (0 for one replica, which has nothing to exchange)."""
        if self.strategy.num_replicas_in_sync == 1:
            return 0.0
        start = time.perf_counter()
        self._all_reduce().numpy()
        return time.perf_counter() - start


def serve(config: Configuration, profile_steps: int = 0, profile_dir: str | None = None,
          requests: TextIO = sys.stdin, replies: TextIO = sys.stdout) -> None:
    """Builds ``config``, warms up, then answers ``RUN k`` requests until end of input.

    Args:
        config: What to train.
        profile_steps: After warm-up, trace this many more steps (not measured) for
            TensorBoard's profiler into ``profile_dir``; 0: none.
        profile_dir: Where the trace goes.
        requests: Where ``RUN k`` lines come from.
        replies: Where ``READY`` and ``DONE`` lines go.

    Raises:
        ValueError: For a request that is not ``RUN k`` with ``k`` of at least two calls.
    """
    trainer = _Trainer(config)
    trainer.train(max(config.warmup_steps, 2 * config.steps_per_execution))
    # When the first compiled call ended, on the wall clock the runner reads too.
    trainer.info["first_step_at"] = time.time() - (time.perf_counter() - trainer.timer.ends[0][0])
    trainer.all_reduce_seconds()  # Traces it.
    if profile_steps:
        # Every worker of a job trains the steps; only the chief traces them (see
        # tfpar.training.run: TensorFlow's profiler aborts now and then in other workers).
        chief = cluster_spec.is_chief(trainer.strategy)
        trainer.train(profile_steps,
                      [ProfileSteps(1, profile_steps, profile_dir or "")] if chief else [])
    replies.write(f"READY {json.dumps(trainer.info)}\n")
    replies.flush()
    for line in requests:
        verb, _, count = line.strip().partition(" ")
        if verb != "RUN" or not count.isdigit() or int(count) < 2 * config.steps_per_execution:
            raise ValueError(f"Expected 'RUN k' with k >= {2 * config.steps_per_execution} "
                             f"(two compiled calls). Received: {line.strip()!r}.")
        seconds, steps = trainer.train(int(count))
        replies.write(f"DONE {seconds!r} {steps} {trainer.all_reduce_seconds()!r}\n")
        replies.flush()


def main() -> None:
    """Serves ``sys.argv[1:]``: a configuration, then optionally profile steps and directory.

    A configuration error is one ``ERROR`` line.
    """
    profile_steps, profile_dir = (int(sys.argv[2]), sys.argv[3]) if len(sys.argv) > 2 else (0, None)
    try:
        serve(Configuration.from_json(sys.argv[1]), profile_steps, profile_dir)
    except TfparError as e:
        print(f"ERROR {json.dumps({'message': e.template, 'argument': e.argument})}",
              flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
