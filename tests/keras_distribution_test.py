"""Tests of :mod:`tfpar.keras_distribution` (and its hook, :mod:`tfpar.compat.keras_distribution`):
Keras's own ``keras.distribution.DataParallel`` trains data-parallel on TensorFlow through a tfpar
entry, ends where the entry ends, and what tfpar cannot run is refused in one line."""

import io
import os
import subprocess
import sys

import indexed_job_pods  # The pods of an Indexed Job, emulated.
import keras
import numpy as np
import pytest
import tensorflow as tf
from slurm_test import outputs_of
from slurm_test import srun_environment

from tfpar import keras_distribution
from tfpar import strategies
from tfpar import testing
from tfpar.cluster import launcher
from tfpar.cluster import private_network
from tfpar.compat import keras_distribution as keras_hook
from tfpar.errors import ConfigError
from tfpar.errors import RegistryError


def build() -> keras.Model:
    """The same compiled model each call: LayerNorm, Adam (seeded; no per-replica BatchNorm
    statistics nor random streams, so several devices compute what one does)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.LayerNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(21, 6)).astype("float32")
    y = rng.integers(0, 3, size=21)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # A last batch of 5.


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in model.trainable_variables]


class KerasDistributionTest(testing.StrategyTestCase):
    NUM_DEVICES = 4

    def setUp(self):
        super().setUp()
        keras_distribution.install()
        self.addCleanup(keras_distribution.uninstall)
        self.addCleanup(keras.distribution.set_distribution, None)

    def fit_under(self, distribution) -> keras.Model:
        keras.distribution.set_distribution(distribution)
        try:
            model = build()
        finally:
            keras.distribution.set_distribution(None)
        model.fit(data(), epochs=2, verbose=0)
        return model

    def test_list_devices_are_the_logical_cpu_devices(self):
        self.assertEqual(keras.distribution.list_devices(), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
        self.assertEqual(keras.distribution.get_device_count(), 4)

    def test_data_parallel_ends_where_the_entry_ends_and_near_one_device(self):
        one_device = build()
        one_device.fit(data(), epochs=2, verbose=0)
        for count in (2, 4):
            devices = keras.distribution.list_devices()[:count]
            model = self.fit_under(keras.distribution.DataParallel(devices=devices))
            self.assertEqual(model.distribute_strategy.num_replicas_in_sync, count)
            self.assertEqual(strategies.selection(model.distribute_strategy).name, "allreduce")
            with strategies.get("allreduce", count).scope():
                entry = build()
            entry.fit(data(), epochs=2, verbose=0)
            for mine, theirs, reference in zip(weights(model), weights(entry),
                                               weights(one_device)):
                self.assertAllEqual(mine, theirs)  # Bit for bit: the entry's own run.
                self.assertAllClose(mine, reference, rtol=1e-5, atol=1e-6)
            self.assertReplicasInSync(model)
            self.assertEqual(model.evaluate(data(), verbose=0),
                             entry.evaluate(data(), verbose=0))
            self.assertAllEqual(model.predict(data(), verbose=0),
                                entry.predict(data(), verbose=0))

    def test_by_mesh_with_neither_and_through_its_scope(self):
        mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices=["cpu:0", "cpu:1"])
        model = self.fit_under(keras.distribution.DataParallel(device_mesh=mesh))
        self.assertEqual(model.distribute_strategy.num_replicas_in_sync, 2)
        model = self.fit_under(keras.distribution.DataParallel())
        self.assertEqual(model.distribute_strategy.num_replicas_in_sync, 4)
        with keras.distribution.DataParallel(devices=["cpu:2", "cpu:3"]).scope():
            model = build()
        self.assertIsNone(keras.distribution.distribution())
        self.assertFalse(tf.distribute.has_strategy())  # The scope's strategy left with it.
        model.fit(data(), verbose=0)
        self.assertEqual(model.distribute_strategy.extended.worker_devices,
                         ("/job:localhost/replica:0/task:0/device:CPU:2",
                          "/job:localhost/replica:0/task:0/device:CPU:3"))

    def test_the_entry_and_its_options_are_chosen_keras_style(self):
        keras_distribution.install("mirrored")
        model = self.fit_under(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"]))
        self.assertEqual(strategies.selection(model.distribute_strategy).name, "mirrored")
        model = self.fit_under(keras_distribution.DataParallel(
            devices=["cpu:0", "cpu:1"], strategy="allreduce", virtual_replicas=4))
        selection = strategies.selection(model.distribute_strategy)
        self.assertEqual((selection.name, selection.options["virtual_replicas"]),
                         ("allreduce", 4))
        with self.assertRaisesRegex(RegistryError, "virtual_replicas"):
            keras_distribution.DataParallel(strategy="mirrored", virtual_replicas=4)

    def variable_with_layout(self, axes: list) -> keras.Variable:
        """A variable made with its own layout on a 1-D mesh of 2 devices, while a
        DataParallel over them is set."""
        mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices=["cpu:0", "cpu:1"])
        with keras.distribution.DataParallel(device_mesh=mesh).scope():
            return keras.Variable(initializer="ones", shape=(4, 2),
                                  layout=keras.distribution.TensorLayout([*axes, None], mesh))

    def test_a_variable_with_its_own_replicated_layout_is_mirrored(self):
        value = self.variable_with_layout([None]).value
        self.assertLen(value.values, 2)

    def test_what_tfpar_cannot_run_is_refused_in_one_line_and_nothing_is_set(self):
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                             devices=keras.distribution.list_devices())
        refused = [
            lambda: keras.distribution.set_distribution(keras.distribution.ModelParallel(
                layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")),
            lambda: keras.distribution.set_distribution(
                keras_distribution.DataParallel(device_mesh=mesh)),
            lambda: keras.distribution.distribute_tensor(
                tf.ones((4, 2)), keras.distribution.TensorLayout(["batch", None], mesh)),
            # A variable's own sharded layout (Keras's TensorFlow backend ignores it).
            lambda: self.variable_with_layout(["batch"]),
            # A distribution of a user's own (here Keras's base class): refused as what it
            # is, not as one that shards.
            lambda: keras.distribution.set_distribution(
                keras.distribution.DataParallel.__mro__[1](keras.distribution.DeviceMesh(
                    (4,), ["batch"], mesh.devices.ravel()))),
            lambda: keras.distribution.initialize(num_processes=2, process_id=0),
        ]
        for refuse in refused:
            with self.assertRaises(ConfigError) as caught:
                refuse()
            if "Received: Distribution" in str(caught.exception):
                self.assertNotIn("shards", str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))
            self.assertIsNone(keras.distribution.distribution())
            self.assertFalse(tf.distribute.has_strategy())
        self.assertRegex(str(caught.exception), r"needs every process's host:port .*"
                                                r"0 addresses for num_processes=2")
        with strategies.get("mirrored", 2).scope(), self.assertRaisesRegex(
                ConfigError, "inside a tf.distribute strategy's scope"):
            keras.distribution.set_distribution(keras.distribution.DataParallel())

    def test_a_model_built_without_the_distribution_is_refused_by_fit_while_it_is_set(self):
        plain = build()
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        with self.assertRaisesRegex(ConfigError, r"^The model .* was built outside the "
                                                 r"strategy its train_step runs under"):
            plain.fit(data(), verbose=0)
        keras.distribution.set_distribution(None)
        plain.fit(data(), verbose=0)

    def test_an_install_that_refuses_the_distribution_set_installs_nothing(self):
        keras_distribution.uninstall()
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                             devices=keras.distribution.list_devices())
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"))
        with self.assertRaisesRegex(ConfigError, "ModelParallel shards"):
            keras_distribution.install()
        self.assertFalse(keras_hook.installed())
        self.assertFalse(tf.distribute.has_strategy())

    def test_without_tfpar_keras_trains_on_one_device(self):
        # What Keras 3.15 does alone on TensorFlow: the distribution is accepted, and the model
        # trains under the default strategy, every variable on one device.
        keras_distribution.uninstall()
        self.assertFalse(keras_hook.installed())
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = build()
        keras.distribution.set_distribution(None)
        self.assertEqual(model.distribute_strategy.num_replicas_in_sync, 1)


@pytest.mark.cluster  # Two jobs of two processes: `pytest -m cluster`.
class AcrossProcessesTest(tf.test.TestCase):

    def run_job(self, path: str, local_devices: int | str) -> tuple[int, str, str]:
        output = os.path.join(self.get_temp_dir(), f"{path}_{local_devices}.npz")
        out = io.StringIO()
        worker = os.path.join(os.path.dirname(__file__), "cluster",
                              "keras_distribution_worker.py")
        status = launcher.launch([sys.executable, worker, path, str(local_devices), output], 2,
                                 out=out)
        return status, out.getvalue(), output

    def job(self, path: str, local_devices: int) -> tuple[list[np.ndarray], str]:
        status, out, output = self.run_job(path, local_devices)
        self.assertEqual(status, 0, out[-3000:])
        return list(np.load(output).values()), out

    @staticmethod
    def start(place, rank: int, command: list[str], environ: dict) -> subprocess.Popen:
        """Task ``rank`` as srun starts it (``place``: the node's network) or as pod ``rank``."""
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        if isinstance(place, private_network.Namespace):
            return subprocess.Popen(command, env={**environ, **srun_environment(
                job_id="4250", rank=rank)}, preexec_fn=place.enter, **output)
        return place.popen(rank, command, env=environ, **output)

    def test_the_same_script_under_slurm_and_kubernetes_trains_as_the_entry_does(self):
        # The job as srun starts a step's tasks (one node, its own loopback), and as the pods
        # of an Indexed Job behind a headless Service (each pod its own address and hostname):
        # no launcher, no TF_CONFIG.
        worker = os.path.join(os.path.dirname(__file__), "cluster",
                              "keras_distribution_worker.py")
        base = {key: value for key, value in os.environ.items()
                if key not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
        results = {}
        for where in ("slurm", "kubernetes"):
            output = os.path.join(self.get_temp_dir(), f"{where}.npz")
            command = [sys.executable, worker, "keras", "1", output]
            place = (private_network.Namespace() if where == "slurm"
                     else indexed_job_pods.IndexedJobPods(self.get_temp_dir()))
            with place:
                tasks = [self.start(place, rank, command, base) for rank in range(2)]
                outputs = outputs_of(tasks)
            for task, out in zip(tasks, outputs):
                self.assertEqual(task.returncode, 0, out[-3000:])
                self.assertIn("devices cpu:0 cpu:1", out)
                self.assertIn("entry multi_worker_allreduce 2", out)
            results[where] = list(np.load(output).values())
        for a, b in zip(results["slurm"], results["kubernetes"]):
            self.assertAllEqual(a, b)
        one_device = build()
        one_device.fit(data(), epochs=2, verbose=0)
        for a, b in zip(results["kubernetes"], weights(one_device)):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)

    def test_each_process_reading_its_own_share_trains_on_every_example(self):
        # DataParallel(auto_shard_dataset=False): each process's batch of 4 (every other
        # example) is its share of a global batch of 8, so each step trains on one device's
        # batch; TensorFlow alone took a process's batch for the global batch (each step
        # trained on 4 examples, and 9 of 21 were left out of every epoch).
        one_device = build()
        # Of unknown cardinality, as the processes' own datasets are (Keras then calls the step
        # once more at each epoch's end, which moves Adam's moments, on one device too).
        one_device.fit(data().unbatch().batch(8), epochs=2, verbose=0)
        for local_devices in (1, 2):
            status, out, output = self.run_job("keras_own", local_devices)
            self.assertEqual(status, 0, out[-3000:])
            # A DataParallel that shards, set after it, would read this job's input twice.
            self.assertIn("refused: Across processes every DataParallel of a job trains through "
                          "its one strategy, which reads the input one way: each must have the "
                          "auto_shard_dataset of the first (False). Received: "
                          "auto_shard_dataset=True.", out)
            for a, b in zip(np.load(output).values(), weights(one_device)):
                self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)
        # Inputs of known, unequal numbers of batches: one line, not TensorFlow's collectives'
        # error in the step after the shorter ends.
        status, out, _ = self.run_job("keras_own_uneven", 1)
        self.assertNotEqual(status, 0)
        self.assertIn("ConfigError: Under auto_shard_dataset=False each worker's batch of a step "
                      "is its share of the step's global batch, so every worker's input must "
                      "give as many batches; this job's give worker 0: 2, worker 1: 3.", out)
        # virtual_replicas cuts the global batch by position, which no process has whole.
        status, out, _ = self.run_job("keras_own_virtual", 1)
        self.assertNotEqual(status, 0)
        self.assertIn("ConfigError: virtual_replicas and split_weights cut the global batch by "
                      "position, which needs every worker to read the whole input", out)

    def test_workers_of_unequal_device_counts_are_refused_instead_of_waiting(self):
        # TensorFlow sizes a collective by this worker's devices times the workers: 2 devices
        # and 1 would wait for each other in the first all-reduce until stopped (here: the
        # timeout fails the test).
        worker = os.path.join(os.path.dirname(__file__), "cluster",
                              "keras_distribution_worker.py")
        job = subprocess.run(
            [sys.executable, "-m", "tfpar.cli.launch", "--num_workers=2", "--", sys.executable,
             worker, "keras", "uneven", os.path.join(self.get_temp_dir(), "unused.npz")],
            capture_output=True, text=True, timeout=240)
        self.assertNotEqual(job.returncode, 0)
        self.assertIn("ConfigError: Every worker of a job must train on as many devices as the "
                      "others (TensorFlow's all-reduce spans each worker's devices times the "
                      "workers); this job's have worker 0: 2, worker 1: 1.", job.stdout)

    def test_a_data_parallel_over_every_process_trains_as_the_entry_does(self):
        for local_devices in (1, 2):
            mine, output = self.job("keras", local_devices)
            every = " ".join(f"cpu:{i}" for i in range(2 * local_devices))
            self.assertIn(f"[worker 1] devices {every}", output)
            self.assertIn("[worker 1] set by /device:CPU:0", output)
            self.assertIn(f"[worker 0] entry multi_worker_allreduce {2 * local_devices}", output)
            theirs, _ = self.job("entry", local_devices)
            for a, b in zip(mine, theirs):
                self.assertAllEqual(a, b)
        self.assertEqual(mine[-1].shape, (21, 3))  # Every example predicted, in order.
        one_device = build()
        one_device.fit(data(), epochs=2, verbose=0)
        for a, b in zip(mine, [*weights(one_device), one_device.evaluate(data(), verbose=0),
                               one_device.predict(data(), verbose=0)]):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)
