"""Tests that a multi-worker process of several logical CPU devices runs a replica on each
(tfpar.compat.multi_worker_cpus), where TensorFlow's strategy alone runs one, and trains as one
device does."""

import io
import sys
import textwrap

import tensorflow as tf

from tfpar.cluster import launcher

# One worker of a one-worker cluster (the launcher's TF_CONFIG), two logical CPU devices.
PROGRAM = textwrap.dedent("""
    import sys
    from tfpar import devices
    devices.ensure_logical_cpus(2)
    import keras
    import numpy as np
    import tensorflow as tf
    import tfpar
    from tfpar import testing

    if sys.argv[1] == "tensorflow":
        from tfpar.cluster import spec
        strategy = tf.distribute.MultiWorkerMirroredStrategy(spec.resolver())
    else:
        strategy = tfpar.strategies.get(sys.argv[1], 2)
    print("replicas", strategy.num_replicas_in_sync, *strategy.extended.worker_devices)
    if sys.argv[1] != "tensorflow":
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = testing.tiny_model()
        keras.utils.set_random_seed(0)
        alone = testing.tiny_model()
        for each in (model, alone):
            each.fit(testing.tiny_dataset(), epochs=2, verbose=0)
        print("largest difference", max(float(np.max(np.abs(a - b)))
              for a, b in zip(model.get_weights(), alone.get_weights())))
    """)


class MultiWorkerCpusTest(tf.test.TestCase):

    def run_worker(self, entry: str) -> str:
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", PROGRAM, entry], 1, out=out)
        self.assertEqual(status, 0, out.getvalue()[-3000:])
        return out.getvalue()

    def test_tensorflow_alone_runs_one_cpu_replica_per_worker(self):
        # What the workaround is for: the second logical device is left out.
        self.assertIn("replicas 1 /job:worker/replica:0/task:0/device:CPU:0\n",
                      self.run_worker("tensorflow"))

    def test_each_logical_cpu_device_of_a_worker_runs_a_replica_and_trains_as_one_device(self):
        for entry in ("multi_worker", "multi_worker_allreduce"):
            with self.subTest(entry=entry):
                output = self.run_worker(entry)
                self.assertIn("replicas 2 /job:worker/replica:0/task:0/device:CPU:0 "
                              "/job:worker/replica:0/task:0/device:CPU:1\n", output)
                difference = float(output.split("largest difference ")[1].split()[0])
                self.assertLess(difference, 1e-5)


if __name__ == "__main__":
    tf.test.main()
