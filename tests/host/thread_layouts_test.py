"""Tests of thread layouts: candidates, the store per machine kind, and the split using it."""

import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import tensorflow as tf

from tfpar.host import thread_layouts
from tfpar.host.thread_layouts import ThreadLayout


class ThreadLayoutsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.path = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), "layouts.json")
        self.enter_context(mock.patch.dict(os.environ, {thread_layouts.TUNING_FILE_ENV: self.path}))

    def test_default_shares_the_cores_and_candidates_start_with_it(self):
        self.assertEqual(thread_layouts.default(2, cores=8), ThreadLayout(4))
        self.assertEqual(thread_layouts.default(4, cores=2), ThreadLayout(1))
        self.assertEqual(thread_layouts.candidates(2, cores=8), [
            ThreadLayout(4), ThreadLayout(4, per_device_pools=False), ThreadLayout(8),
            ThreadLayout(4, inter_op_threads=4)])
        self.assertEqual(ThreadLayout(1).describe(2),
                         "1 intra-op thread(s) per device, a pool each, 2 inter-op")

    def test_a_stored_layout_is_chosen_on_this_machine_kind_only(self):
        self.assertEqual(thread_layouts.chosen(2),
                         (thread_layouts.default(2), "default (not tuned on this machine kind)"))
        layout = ThreadLayout(3, per_device_pools=False, inter_op_threads=5)
        self.assertEqual(thread_layouts.store(2, layout, model="lenet", speedup=1.07), self.path)
        self.assertEqual(thread_layouts.chosen(2), (layout, "tuned with lenet, 1.07x the default"))
        thread_layouts.store(2, layout, model="lenet", speedup=1.07,
                             steps_per_execution={"8": 1.11})
        self.assertEqual(thread_layouts.chosen(2)[1], "tuned with lenet, 1.07x the default; "
                                                      "8 steps per compiled call 1.11x")
        self.assertEqual(thread_layouts.chosen(4)[0], thread_layouts.default(4))
        with mock.patch.dict(os.environ, {"ONEDNN_MAX_CPU_ISA": "AVX2"}):  # Another kind.
            self.assertEqual(thread_layouts.chosen(2)[0], thread_layouts.default(2))
        with open(self.path) as f:
            self.assertEqual(list(json.load(f)), [thread_layouts.machine_key()])

    def test_workers_on_one_host_keep_tensorflows_threads_until_tuned(self):
        self.assertEqual(thread_layouts.worker_candidates(2, cores=8), [
            ThreadLayout(8, inter_op_threads=8), ThreadLayout(4, inter_op_threads=1),
            ThreadLayout(4, inter_op_threads=2)])
        self.assertEqual(thread_layouts.chosen_for_workers(2), (
            None, "TensorFlow's own threads (not tuned on this machine kind)"))
        thread_layouts.store(thread_layouts.workers_key(2), ThreadLayout(1, inter_op_threads=1),
                             model="lenet", speedup=1.13)
        self.assertEqual(thread_layouts.chosen_for_workers(2), (
            ThreadLayout(1, inter_op_threads=1), "tuned with lenet, 1.13x the default"))
        self.assertEqual(thread_layouts.chosen(2)[0], thread_layouts.default(2))  # Devices: not.
        self.assertIsNone(thread_layouts.chosen_for_workers(4)[0])

    def test_a_multi_worker_strategy_uses_the_layout_tuned_for_its_host(self):
        thread_layouts.store(thread_layouts.workers_key(2), ThreadLayout(1, inter_op_threads=1))
        code = ("import os, tensorflow as tf\n"
                "from tfpar.cluster import spec\n"
                "from tfpar.host import worker_threads\n"
                "cluster, task_type, index = spec.parse_tf_config(os.environ['TF_CONFIG'])\n"
                "print(worker_threads.set_threads(spec.tasks_on_host(cluster, task_type, index)),\n"
                "      tf.config.threading.get_intra_op_parallelism_threads(),\n"
                "      tf.config.threading.get_inter_op_parallelism_threads())\n")
        # Two workers on this host and one elsewhere: the layout tuned for 2 applies.
        tf_config = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223",
                                                       "10.0.0.9:2222"]},
                                "task": {"type": "worker", "index": 1}})
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TF_NUM_") and k != "OMP_NUM_THREADS"}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env={**env, "TF_CONFIG": tf_config})
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(result.stdout.split(), ["tuned", "1", "1"])

    def test_threads_the_user_set_or_a_lone_worker_keep_tensorflows_own(self):
        from tfpar.host import worker_threads

        thread_layouts.store(thread_layouts.workers_key(2), ThreadLayout(1, inter_op_threads=1))
        threading = tf.config.threading
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TF_NUM_") and k != "OMP_NUM_THREADS"}
        # This process's TensorFlow runs already: its thread calls are stood in for.
        with mock.patch.dict(os.environ, env, clear=True), \
                mock.patch.object(threading, "get_intra_op_parallelism_threads", lambda: 0), \
                mock.patch.object(threading, "get_inter_op_parallelism_threads", lambda: 0), \
                mock.patch.object(threading, "set_intra_op_parallelism_threads") as set_intra:
            for user_set, workers, source in (
                    ({}, 2, "tuned"),
                    ({"TF_NUM_INTEROP_THREADS": "2"}, 2, "kept"),
                    ({}, 1, "kept"),  # Alone on its host.
                    ({"OMP_NUM_THREADS": "3"}, 2, "budget")):
                with mock.patch.dict(os.environ, user_set), \
                        mock.patch.object(threading, "set_inter_op_parallelism_threads"):
                    set_intra.reset_mock()
                    self.assertEqual(worker_threads.set_threads(workers), source)
                    self.assertEqual(set_intra.call_args_list,
                                     {"tuned": [mock.call(1)], "budget": [mock.call(3)]}.get(
                                         source, []))

    def test_an_unreadable_store_means_the_default(self):
        with open(self.path, "w") as f:
            f.write("{not json")
        self.assertEqual(thread_layouts.chosen(2)[0], thread_layouts.default(2))
        thread_layouts.store(2, ThreadLayout(2))  # Replaced whole, readable again.
        self.assertEqual(thread_layouts.chosen(2)[0], ThreadLayout(2))

    def test_splitting_the_cpu_uses_the_stored_layout(self):
        thread_layouts.store(2, ThreadLayout(3, per_device_pools=False, inter_op_threads=5))
        code = ("import os, tensorflow as tf\n"
                "from tfpar import devices\n"
                "devices.ensure_logical_cpus(2)\n"
                "print(tf.config.threading.get_intra_op_parallelism_threads(),\n"
                "      tf.config.threading.get_inter_op_parallelism_threads(),\n"
                "      os.environ['TF_OVERRIDE_GLOBAL_THREADPOOL'],\n"
                "      len(tf.config.list_logical_devices('CPU')))\n")
        env = {k: v for k, v in os.environ.items() if k != "TF_OVERRIDE_GLOBAL_THREADPOOL"}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env=env)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(result.stdout.split(), ["3", "5", "0", "2"])


class ThreadsHomeTest(tf.test.TestCase):

    def test_pools_per_device_unless_the_layout_shares_one_or_the_user_chose(self):
        env = thread_layouts.PER_DEVICE_THREAD_POOLS_ENV
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop(env, None)
            thread_layouts.use_pools(None)
            self.assertEqual(os.environ[env], "1")
            thread_layouts.use_pools(ThreadLayout(1, per_device_pools=False))
            self.assertEqual(os.environ[env], "1")  # The value set first is kept...
            thread_layouts.use_pools(ThreadLayout(1, per_device_pools=False), replace=True)
            self.assertEqual(os.environ[env], "0")  # ...unless replaced (a timed candidate).

    def test_a_split_gets_the_tuned_layout_and_tensorflow_its_threads(self):
        # A fresh process: threads are set before TensorFlow initialises.
        code = ("import os\n"
                "from tfpar import devices\n"
                "devices.ensure_logical_cpus(2)\n"
                "import tensorflow as tf\n"
                "print(os.environ['TF_OVERRIDE_GLOBAL_THREADPOOL'],\n"
                "      tf.config.threading.get_intra_op_parallelism_threads(),\n"
                "      tf.config.threading.get_inter_op_parallelism_threads())\n")
        store = os.path.join(self.get_temp_dir(), "layouts.json")
        environ = {**os.environ, "TFPAR_TUNING_FILE": store, "TF_CPP_MIN_LOG_LEVEL": "2"}
        environ.pop("TF_OVERRIDE_GLOBAL_THREADPOOL", None)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env=environ)
        expected = thread_layouts.default(2)
        self.assertEqual(result.stdout.split(), ["1", str(expected.threads_per_device), "2"],
                         result.stderr[-2000:])


if __name__ == "__main__":
    tf.test.main()
