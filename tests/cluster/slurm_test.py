"""Tests of the cluster SLURM's srun gives a step: CPU-only and GPU nodes, ports per job."""

import json
import os
import stat
import subprocess
import sys
from unittest import mock

import multi_worker_worker  # The worker program, importable for its model.
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import private_network
from tfpar.cluster import slurm
from tfpar.cluster import spec as cluster
from tfpar.errors import ClusterError

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multi_worker_worker.py")


def srun_environment(job_id="4242", rank=0, tasks=2, nodes="localhost", per_node="2", **more):
    """What srun sets for task ``rank`` of a step (the variables the cluster is made of)."""
    return {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": per_node, **more}


def outputs_of(tasks: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Each task's output once it exited (every task killed if one overruns ``timeout``)."""
    try:
        return [task.communicate(timeout=timeout)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()


def stand_in_nvidia_smi(directory: str, gpus: int) -> str:
    """An ``nvidia-smi`` that lists ``gpus`` GPUs, in ``directory`` (for PATH)."""
    path = os.path.join(directory, "nvidia-smi")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: Stand-in (UUID: GPU-{i})'\n"
                                        for i in range(gpus)))
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


class SlurmTest(tf.test.TestCase, parameterized.TestCase):

    def resolve(self, environ, path=""):
        """The cluster spec and this task's place, with ``environ`` and ``PATH=path``."""
        with mock.patch.dict(os.environ, {**environ, "PATH": path}, clear=True):
            resolver = cluster.resolver("slurm")
            spec = resolver.cluster_spec().as_dict()
            return spec, resolver.task_type, resolver.task_id, os.environ.get(
                "CUDA_VISIBLE_DEVICES")

    def test_a_cpu_only_node_without_nvidia_smi(self):
        base = slurm.port_base(srun_environment(), 2)
        spec, task_type, task_id, visible = self.resolve(srun_environment(rank=1))
        self.assertEqual(spec, {"worker": [f"localhost:{base}", f"localhost:{base + 1}"]})
        self.assertEqual((task_type, task_id), ("worker", 1))
        self.assertIsNone(visible)  # The task's devices are left as they are.

    def test_tasks_over_several_nodes(self):
        environ = srun_environment(rank=2, tasks=5, nodes="node[01-02],gpu7", per_node="2(x2),1")
        spec, _, task_id, _ = self.resolve(environ)
        base = slurm.port_base(environ, 2)
        self.assertEqual(spec["worker"], [f"gpu7:{base}", f"node01:{base}", f"node01:{base + 1}",
                                          f"node02:{base}", f"node02:{base + 1}"])
        self.assertEqual(task_id, 2)

    def test_a_gpu_node_gives_each_task_its_own_gpus(self):
        spec, _, task_id, visible = self.resolve(srun_environment(rank=1),
                                                 path=os.path.dirname(stand_in_nvidia_smi(
                                                     self.get_temp_dir(), 4)))
        self.assertLen(spec["worker"], 2)
        self.assertEqual((task_id, visible), (1, "2,3"))

    def test_a_node_with_fewer_gpus_than_tasks_keeps_what_slurm_gave_each(self):
        _, _, _, visible = self.resolve(srun_environment(rank=1, CUDA_VISIBLE_DEVICES="0"))
        self.assertEqual(visible, "0")

    @parameterized.named_parameters(
        ("one_gpu_per_task", 1, "1", 4), ("several_per_task", 1, "2,3", 4),
        ("a_whole_node", 0, "4,5,6,7", 8), ("none", 1, "", 4))
    def test_the_gpus_slurm_gave_a_task_are_kept(self, rank, given, node_gpus):
        # --gpus-per-task gives each task its own CUDA_VISIBLE_DEVICES; the node shows more.
        smi = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), node_gpus))
        environ = srun_environment(rank=rank, tasks=2 if rank else 1,
                                   per_node="2" if rank else "1", CUDA_VISIBLE_DEVICES=given)
        _, _, task_id, visible = self.resolve(environ, path=smi)
        self.assertEqual((task_id, visible), (rank, given))

    def test_a_tasks_share_is_pinned_before_cuda_starts(self):
        smi = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), 4))
        environ = srun_environment(rank=1, SLURM_LOCALID="1")
        with mock.patch.dict(os.environ, {"PATH": smi}):
            self.assertEqual(slurm.pin_gpus(environ), "2,3")
        self.assertEqual(environ["CUDA_VISIBLE_DEVICES"], "2,3")
        self.assertEqual(slurm.given_gpus(environ), 2)
        # What TensorFlow's resolver then keeps is the same share.
        self.assertEqual(self.resolve(environ, path=smi)[3], "2,3")
        # Slurm's own gift, a CPU node, a node with fewer GPUs than tasks: nothing set.
        for kept in ({"CUDA_VISIBLE_DEVICES": "5"}, {}):
            environ = srun_environment(rank=1, SLURM_LOCALID="1", **kept)
            with mock.patch.dict(os.environ, {"PATH": ""}):
                self.assertIsNone(slurm.pin_gpus(environ))
            self.assertEqual(environ.get("CUDA_VISIBLE_DEVICES"), kept.get(
                "CUDA_VISIBLE_DEVICES"))

    def test_without_slurm_localid_the_share_is_the_one_tensorflows_resolver_gives(self):
        # No SLURM_LOCALID: the task's place on its node follows TensorFlow's layout (nodes
        # sorted, each node's tasks in rank order), so the share pinned before CUDA starts is
        # the one the resolver would set after: rank 2 is node01's second task.
        smi = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), 4))
        environ = srun_environment(rank=2, tasks=5, nodes="node[01-02],gpu7",
                                   per_node="2(x2),1")
        self.assertEqual(self.resolve(environ, path=smi)[3], "2,3")  # TensorFlow's own.
        with mock.patch.dict(os.environ, {"PATH": smi}):
            self.assertEqual(slurm.pin_gpus(environ), "2,3")
        self.assertEqual(slurm.expand_hostlist("n[1-2],m5,o[03-04,6]"),
                         ["n1", "n2", "m5", "o03", "o04", "o6"])
        self.assertEqual(slurm.local_id(srun_environment(rank=1, SLURM_LOCALID="0")), 0)

    def test_an_empty_slurm_localid_is_a_missing_one(self):
        # A scheduler (or a container's env file) that sets SLURM_LOCALID= empty: the share
        # comes from the task's place, as without it (it was silently not pinned at all).
        smi = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), 4))
        environ = srun_environment(rank=1, SLURM_LOCALID="")
        with mock.patch.dict(os.environ, {"PATH": smi}):
            self.assertEqual(slurm.pin_gpus(environ), "2,3")
        self.assertEqual(slurm.local_id(srun_environment(rank=1, SLURM_LOCALID=" ")), 1)

    def test_a_host_list_tensorflow_refuses_is_refused(self):
        # "n[1-2]-ib" was read as three hosts, n1, n2 and "-ib", where TensorFlow's resolver
        # refuses it: a task's place (so its GPU share) came from a host list that is not
        # the step's.
        for text in ("n[1-2]-ib", "n[1-2]x[3-4]", "a-b[1-2]c", "n[1-2"):
            with self.assertRaises(ClusterError, msg=text):
                slurm.expand_hostlist(text)
        self.assertEqual(slurm.expand_hostlist("gpu-[1-2],a"), ["gpu-1", "gpu-2", "a"])

    def test_the_train_command_pins_and_counts_them_before_tensorflow_starts(self):
        # The order that matters: CUDA reads CUDA_VISIBLE_DEVICES once, when TensorFlow first
        # lists the GPUs; the share is set while the flags become a config, before any import.
        smi = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), 4))
        code = ("import os, sys\n"
                "from tfpar.cli import train\n"
                "train.FLAGS(['tfpar-train', '--strategy=multi_worker', '--dataset=digits'])\n"
                "config, device_sets = train.config_from_flags()\n"
                "print(os.environ['CUDA_VISIBLE_DEVICES'], device_sets, "
                "'tensorflow' in sys.modules)\n")
        environ = {**os.environ, **srun_environment(rank=1, SLURM_LOCALID="1"),
                   "PATH": f"{smi}:{os.environ['PATH']}"}
        environ.pop("CUDA_VISIBLE_DEVICES", None)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=environ, timeout=120)
        self.assertEqual(result.stdout.split(), ["2,3", "[2]", "False"], result.stderr[-2000:])

    def test_an_nvidia_smi_listing_no_gpu_is_a_cpu_node(self):
        spec, _, _, visible = self.resolve(srun_environment(), path=os.path.dirname(
            stand_in_nvidia_smi(self.get_temp_dir(), 0)))
        self.assertLen(spec["worker"], 2)
        self.assertIsNone(visible)

    def test_two_jobs_on_one_node_use_other_ports(self):
        ports = set()
        for job_id in ("4242", "4243", "4249", "123456"):
            spec = self.resolve(srun_environment(job_id=job_id))[0]
            ports |= {int(address.rsplit(":", 1)[1]) for address in spec["worker"]}
        self.assertLen(ports, 8)
        self.assertTrue(all(slurm.PORT_LOW <= port < slurm.PORT_HIGH for port in ports))

    def test_jobs_whose_blocks_meet_part_at_their_next_step(self):
        blocks = (slurm.PORT_HIGH - slurm.PORT_LOW) // slurm.PORT_BLOCK
        self.assertEqual(blocks, 781)
        first, second = (srun_environment(job_id=str(job)) for job in (4242, 4242 + blocks))
        self.assertEqual(slurm.port_base(first, 2), slurm.port_base(second, 2))
        retried = {**second, "SLURM_STEP_ID": "1"}
        self.assertNotIn(slurm.port_base(retried, 2),
                         {slurm.port_base({**first, "SLURM_STEP_ID": str(step)}, 2)
                          for step in range(4)})
        self.assertNotEqual(slurm.port_base({**first, "SLURM_STEP_ID": "1"}, 2),
                            slurm.port_base(retried, 2))

    def test_ports_srun_reserved_are_used(self):
        environ = srun_environment(SLURM_STEP_RESV_PORTS="12000-12003")
        self.assertEqual(slurm.port_base(environ, 2), 12000)
        spec = self.resolve(environ)[0]
        self.assertEqual(spec["worker"], ["localhost:12000", "localhost:12001"])
        with self.assertRaisesRegex(ClusterError, r"^srun reserved the ports 12000,12005 for "
                                                  r"this step; its 2 tasks on a node need as "
                                                  r"many consecutive ports\."):
            slurm.port_base(srun_environment(SLURM_STEP_RESV_PORTS="12000,12005"), 2)
        with self.assertRaisesRegex(ClusterError, r"SLURM_STEP_RESV_PORTS lists ports as"):
            slurm.port_base(srun_environment(SLURM_STEP_RESV_PORTS="twelve"), 2)

    def test_tasks_per_node(self):
        self.assertEqual(slurm.tasks_per_node("2(x3),1"), [2, 2, 2, 1])
        with self.assertRaisesRegex(ClusterError, r"as '2\(x3\),1'\. Received: '2x3'"):
            slurm.tasks_per_node("2x3")

    @parameterized.named_parameters(
        ("no_step", {"SLURM_JOB_ID": "7"}, r"SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
                                           r"SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE are "
                                           r"not set\. Start every worker with srun"),
        ("bad_rank", srun_environment(SLURM_PROCID="x"),
         r"SLURM_PROCID must be a whole number\. Received: 'x'"),
        ("no_job", {}, r"; SLURM_JOB_ID, SLURM_PROCID, .* are not set"))
    def test_what_srun_did_not_set_is_named(self, environ, message):
        with self.assertRaisesRegex(ClusterError, message):
            self.resolve(environ)


class EmulatedSrunTest(tf.test.TestCase):
    """Three jobs on one node at once, started as srun starts a step's tasks: 2 tasks on a
    CPU-only node, 2 where an nvidia-smi lists GPUs (that TensorFlow then does not find), and 4
    tasks (one thread each, sharing the node's cores)."""

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_two_jobs_on_one_node_train_as_one_process(self):
        reference = multi_worker_worker.model_with_metric()
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        np.savez(initial, *reference.get_weights())
        with_gpus = os.path.dirname(stand_in_nvidia_smi(self.get_temp_dir(), 2))
        path = os.environ.get("PATH", "")
        jobs = {"4242": (path, 2), "4243": (with_gpus + os.pathsep + path, 2), "4244": (path, 4)}
        tasks = []
        with private_network.Namespace() as network:  # The node: its own loopback.
            for job_id, (path, count) in jobs.items():
                for rank in range(count):
                    environ = {**os.environ, **srun_environment(job_id=job_id, rank=rank,
                                                                tasks=count,
                                                                per_node=str(count)),
                               "PATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}
                    environ.pop("TF_CONFIG", None)
                    environ.pop("CUDA_VISIBLE_DEVICES", None)
                    final = os.path.join(self.get_temp_dir(), f"final_{job_id}.npz")
                    tasks.append(subprocess.Popen(
                        [sys.executable, WORKER, "multi_worker", initial, final,
                         json.dumps({"cluster": "slurm", "cluster_timeout": 120})],
                        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, preexec_fn=network.enter))
        outputs = outputs_of(tasks)
        for task, output in zip(tasks, outputs):
            self.assertEqual(task.returncode, 0, output[-3000:])
        reference.fit(multi_worker_worker.dataset(24), verbose=0, shuffle=False)
        for job_id in jobs:
            final = np.load(os.path.join(self.get_temp_dir(), f"final_{job_id}.npz"))
            for expected, actual in zip(reference.get_weights(), final.values()):
                self.assertAllClose(expected, actual, rtol=1e-5, atol=1e-6)


class PortBlocksTest(tf.test.TestCase):
    """Two jobs on one node whose ids give the same block of ports (781 apart), each started as
    srun starts its tasks and rerun as the sbatch recipe reruns a step that exited 75."""

    def train(self, network, job_id: str, step: int, epochs: int) -> list[subprocess.Popen]:
        tasks = []
        for rank in range(2):
            environ = {**os.environ, **srun_environment(job_id=job_id, rank=rank, tasks=2,
                                                        per_node="2"),
                       "SLURM_STEP_ID": str(step), "TF_CPP_MIN_LOG_LEVEL": "2"}
            for name in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_RESV_PORTS"):
                environ.pop(name, None)
            tasks.append(subprocess.Popen(
                [sys.executable, "-c", "from tfpar.cli import train; train.run()",
                 "--strategy=multi_worker", "--cluster=slurm", "--dataset=digits",
                 "--model=lenet", f"--epochs={epochs}", "--batch_size=128",
                 "--cluster_timeout=60"],
                env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                preexec_fn=network.enter))
        return tasks

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_two_jobs_781_ids_apart_on_one_node_both_train(self):
        first, second = "4242", str(4242 + 781)
        port = slurm.port_base(srun_environment(job_id=first), 2)
        self.assertEqual(port, slurm.port_base(srun_environment(job_id=second), 2))
        with private_network.Namespace() as network:  # The node: its own loopback.
            running = self.train(network, first, 0, epochs=30)
            try:
                # The first job holds its ports once its servers are up.
                probe = ("import socket, sys, time\n"
                         "for _ in range(2400):\n"
                         f"    if socket.socket().connect_ex(('127.0.0.1', {port})) == 0:\n"
                         "        sys.exit(0)\n"
                         "    time.sleep(0.05)\n"
                         "sys.exit(1)\n")
                self.assertEqual(subprocess.run([sys.executable, "-c", probe],
                                                preexec_fn=network.enter,
                                                timeout=180).returncode, 0)
                # The second job's step meets them: exit 75, in one line.
                met = self.train(network, second, 0, epochs=1)
                outputs = [task.communicate(timeout=240)[0] for task in met]
                self.assertIn(75, [task.returncode for task in met], outputs)
                self.assertTrue(all(task.returncode in (75, 69) for task in met), outputs)
                # Its next step takes another block and trains, beside the first job.
                retried = self.train(network, second, 1, epochs=1)
                outputs = [task.communicate(timeout=300)[0] for task in retried + running]
            finally:
                for task in running:
                    task.kill()
        for task, output in zip(retried + running, outputs):
            self.assertEqual(task.returncode, 0, output[-3000:])
        for chief in (outputs[0], outputs[2]):  # Each job's worker 0 reports.
            self.assertIn("test acc:", chief)

