"""Tests of the local launcher: TF_CONFIG per worker, failures, private network, signals."""

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from unittest import mock

import numpy as np
import pytest
import quoted_output
import tensorflow as tf
from absl.testing import parameterized

from tfpar import worker_contract
from tfpar.cluster import launcher
from tfpar.cluster import private_network
from tfpar.cluster.restart_policy import Progress
from tfpar.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def signal_worker_after(launch: subprocess.Popen, saved_line: str, signum: int,
                        num_workers: int = 2) -> tuple[list[str], int]:
    """Reads the job's output up to ``saved_line``, then sends ``signum`` to its last worker
    (the launcher's last child); returns the lines read and the worker's process id."""
    seen = []
    for line in launch.stdout:
        seen.append(line)
        if saved_line in line:
            break
    else:
        raise AssertionError(f"The job ended before {saved_line!r}:\n" + "".join(seen)[-3000:])
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launch.pid)],
                                              capture_output=True, text=True).stdout.split()]
    assert len(workers) == num_workers, workers
    os.kill(max(workers), signum)
    return seen, max(workers)


def train_job(num_workers: int, model_dir: str, *flags: str,
              launcher_flags: tuple = ()) -> subprocess.Popen:
    """Starts ``tfpar-launch`` of ``num_workers`` workers of ``scripts/train.py`` on digits
    (3 epochs, state in ``model_dir``), output piped."""
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "launch.py"),
         f"--num_workers={num_workers}", *launcher_flags, "--", sys.executable,
         os.path.join(ROOT, "scripts", "train.py"), "--dataset=digits",
         f"--model_dir={model_dir}", "--verbose=2", "--epochs=3", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class LauncherTest(tf.test.TestCase, parameterized.TestCase):

    def test_a_failing_worker_stops_the_others(self):
        code = ("import json, os, sys, time\n"
                "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                "print('started', flush=True)\n"
                "sys.exit(3) if rank == 1 else time.sleep(60)\n")
        out = io.StringIO()
        start = time.monotonic()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out)
        self.assertEqual(status, 3)
        self.assertLess(time.monotonic() - start, 30)  # Worker 0 was stopped, not waited for.
        self.assertIn("[worker 0] started", out.getvalue())
        self.assertIn("[worker 1] started", out.getvalue())
        self.assertIn("launcher: worker 1 exited with 3; stopped the other workers.",
                      out.getvalue())

    def test_a_launcher_runs_from_a_thread_other_than_the_main_one(self):
        # As in a Ray worker, whose train loop runs in a thread: Python takes signals in the
        # main thread only, so the launcher installs no handler there, and still runs the job.
        result = {}

        def launch():
            out = io.StringIO()
            result["status"] = launcher.launch([sys.executable, "-c", "print('up')"], 2, out=out)
            result["out"] = out.getvalue()

        thread = threading.Thread(target=launch)
        thread.start()
        thread.join(60)
        self.assertEqual(result.get("status"), 0, result)
        self.assertEqual(result["out"].count("] up"), 2)

    def test_a_job_that_always_fails_stops_after_its_restarts(self):
        model_dir = self.get_temp_dir()
        code = ("import json, os, sys\n"
                "from tfpar import worker_contract\n"  # Its folder, as tfpar's savers declare.
                f"worker_contract.declare(folder={model_dir!r})\n"
                "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                "sys.exit(3 if rank == 1 else 0)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out, max_restarts=2)
        self.assertEqual(status, 3)
        lines = [line for line in out.getvalue().splitlines() if line.startswith("launcher:")]
        self.assertEqual(lines, [
            "launcher: worker 1 exited with 3; stopped the other workers.",
            f"launcher: restart 1 of 2: starting every worker again, resuming from what "
            f"{model_dir} holds.",
            "launcher: worker 1 exited with 3; stopped the other workers.",
            f"launcher: restart 2 of 2: starting every worker again, resuming from what "
            f"{model_dir} holds.",
            "launcher: worker 1 exited with 3; stopped the other workers.",
            "launcher: restarts used up (2 of 2); exiting with the failed worker's status (3)."])

    def assertSameFinalWeights(self, first: str, second: str, run: str) -> None:
        """The model variables of the last checkpoints of ``run`` under two model folders are
        bit for bit the same."""
        final = [tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(d, run)))
                 for d in (first, second)]
        names = [n for n in final[1].get_variable_to_shape_map() if "model_variables" in n]
        self.assertNotEmpty(names)
        for name in names:
            self.assertAllEqual(final[1].get_tensor(name), final[0].get_tensor(name), msg=name)

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_a_killed_worker_is_restarted_and_the_job_ends_as_an_uninterrupted_one(self):
        # The command and the lines the resume guide quotes (block restart_after_a_kill).
        def job(model_dir, max_restarts=2):
            paths = {"/tmp/state": model_dir, "--max_restarts=2": f"--max_restarts={max_restarts}"}
            return subprocess.Popen(
                quoted_output.command("restart_after_a_kill", paths),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})

        killed_dir = os.path.join(self.get_temp_dir(), "killed")
        restarted = job(killed_dir)
        try:
            # Stopped at once, then killed: epoch 3 cannot end without it.
            seen, worker = signal_worker_after(restarted, "Saved training state after epoch 2 ",
                                               signal.SIGSTOP)
            os.kill(worker, signal.SIGKILL)
            output = "".join(seen) + restarted.communicate(timeout=300)[0]
        finally:
            restarted.kill()
        self.assertEqual(restarted.returncode, 0, output[-3000:])
        quoted_output.assert_quoted("restart_after_a_kill", output, {"/tmp/state": killed_dir})
        uninterrupted_dir = os.path.join(self.get_temp_dir(), "uninterrupted")
        uninterrupted = job(uninterrupted_dir, max_restarts=0)
        self.assertEqual(uninterrupted.wait(timeout=300), 0)
        uninterrupted.stdout.close()
        self.assertSameFinalWeights(killed_dir, uninterrupted_dir, "multi_worker_1_devices")

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_automatic_saves_of_a_job_agree_and_a_kill_resumes_from_the_last(self):
        # Each worker times its own steps; the job saves at the longest interval they chose,
        # at the same steps on every worker. Killed (SIGKILL, no notice) after a save inside
        # epoch 2, the job restarts there and ends as an uninterrupted one.
        flags = ("--strategy=multi_worker_allreduce", "--save_every_steps=auto",
                 "--save_budget=0.5")
        killed_dir = os.path.join(self.get_temp_dir(), "killed")
        process = train_job(2, killed_dir, *flags, launcher_flags=("--max_restarts=1",))
        try:
            seen, _ = signal_worker_after(process, "Saved training state at epoch 2 step",
                                          signal.SIGKILL)
            output = "".join(seen) + process.communicate(timeout=300)[0]
        finally:
            process.kill()
        self.assertEqual(process.returncode, 0, output[-3000:])
        # The chief says the interval (the restarted job chooses afresh).
        self.assertRegex(output, r"\[worker 0\] Saving (every \d+ step\(s\) inside an epoch|at "
                                 r"epochs' ends only): ")
        self.assertNotRegex(output, r"\[worker 1\] Saving (every|at)")
        self.assertRegex(output, r"launcher: restart 1 of 1: starting every worker again, "
                                 r"resuming from epoch 2 step \d+ in ")
        whole_dir = os.path.join(self.get_temp_dir(), "whole")
        whole = train_job(2, whole_dir, *flags)
        self.assertEqual(whole.wait(timeout=300), 0)
        whole.stdout.close()
        self.assertSameFinalWeights(killed_dir, whole_dir, "multi_worker_allreduce_1_devices")

    @parameterized.parameters(
        ("epoch_checkpoint", "multi_worker_allreduce"),
        # Keras's own BackupAndRestore, as keras.io's guide teaches it: every worker wrote the
        # same file (h5py "unable to lock file") before tfpar's fix; the chief writes now.
        ("backup", "multi_worker"), ("backup_every_2", "multi_worker_allreduce"),
        # Killed (SIGKILL, no notice) inside epoch 3, after a save at its first step.
        ("backup_every_3", "multi_worker"),
        # Keras's code alone: keras.distribution.DataParallel and BackupAndRestore.
        ("backup_every_3", "keras_distribution"))
    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_a_users_own_resume_loop_under_restarts(self, resume, entry):
        weights = []
        for crash in (True, False):
            base = os.path.join(self.get_temp_dir(), f"{resume}_{crash}")
            os.makedirs(base)
            marker = os.path.join(base, "crashed")
            if not crash:
                open(marker, "w").close()
            out = io.StringIO()
            # The user's script takes no flags: its savers declare their folder to the launcher.
            status = launcher.launch(
                [sys.executable, os.path.join(HERE, "user_resume_worker.py"),
                 os.path.join(base, "state"), marker, os.path.join(base, "final.npz"), resume,
                 entry], 2, out=out, max_restarts=1)
            self.assertEqual(status, 0, out.getvalue()[-3000:])
            if crash:
                # The script's own savers record where it resumes: the launcher names it.
                self.assertRegex(out.getvalue(), r"launcher: restart 1 of 1: starting every "
                                                 r"worker again, resuming from epoch \d( step \d)? "
                                                 r"in \S+state\.")
                if resume == "epoch_checkpoint":
                    self.assertIn("[worker 1] starting at epoch 2", out.getvalue())
                else:
                    self.assertIn("launcher: worker 1 was killed by signal 9", out.getvalue())
            weights.append(list(np.load(os.path.join(base, "final.npz")).values()))
            if resume != "epoch_checkpoint":  # Deleted by the chief at the end, as Keras does.
                self.assertFalse(os.path.exists(os.path.join(base, "state")))
        for restarted, uninterrupted in zip(*weights):
            self.assertAllEqual(uninterrupted, restarted)

    def test_a_launcher_killed_outright_takes_its_workers_with_it(self):
        launch = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(launch.kill)
        for _ in range(2):
            self.assertIn("up", launch.stdout.readline())
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launch.pid)],
                                                  capture_output=True, text=True).stdout.split()]
        self.assertLen(workers, 2)
        launch.kill()
        launch.wait()
        deadline = time.monotonic() + 10
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in workers if _running(pid)]
        self.assertEqual(alive, [])

    def test_a_worker_stopped_by_its_own_signal_is_restarted(self):
        # Exit 130 from a worker (Ctrl-C to it, or SIGTERM to a program that takes no
        # preemption notice) is a failure of that worker, restarted; Ctrl-C to the launcher
        # is not.
        model_dir = self.get_temp_dir()
        marker = os.path.join(model_dir, "stopped_once")
        code = ("import json, os, sys\n"
                "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                f"if rank == 1 and not os.path.exists({marker!r}):\n"
                f"    open({marker!r}, 'w').close(); sys.exit(130)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out, max_restarts=1)
        self.assertEqual(status, 0, out.getvalue())
        self.assertIn("launcher: worker 1 exited with 130; stopped the other workers.\n"
                      "launcher: restart 1 of 1", out.getvalue())

    def test_restarts_are_told_to_the_workers_and_skip_bad_input(self):
        # The workers learn that restarts follow from their environment (the launcher reads
        # no flag of theirs); a command whose chief declares no folder starts again as it is,
        # and the line says so.
        marker = os.path.join(self.get_temp_dir(), "failed_once")
        code = ("import os, sys\n"
                "print('restarts:', os.environ['TFPAR_RESTARTS'])\n"
                f"if not os.path.exists({marker!r}):\n"
                f"    open({marker!r}, 'w').close(); sys.exit(3)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code], 1, out=out, max_restarts=1,
                                 network="host")
        self.assertEqual(status, 0, out.getvalue())
        self.assertIn("launcher: restart 1 of 1: starting every worker again, from scratch (no "
                      "folder of saved state declared yet).\n", out.getvalue())
        self.assertEqual(out.getvalue().count("restarts: 1"), 2, out.getvalue())
        out = io.StringIO()
        self.assertEqual(launcher.launch([sys.executable, "-c", code], 1, out=out,
                                         network="host"), 0)
        self.assertIn("restarts: 0", out.getvalue())
        # A launcher run by a launcher that restarts it: its workers are restarted with it.
        out = io.StringIO()
        with mock.patch.dict(os.environ, {"TFPAR_WORKER_SLOT": "0", "TFPAR_RESTARTS": "1"}):
            self.assertEqual(launcher.launch([sys.executable, "-c", code], 1, out=out,
                                             network="host"), 0)
        self.assertIn("restarts: 1", out.getvalue())
        out = io.StringIO()  # Exit 2 (bad input) fails the same way again: no restart.
        status = launcher.launch([sys.executable, "-c", "import sys; sys.exit(2)"], 1, out=out,
                                 max_restarts=3)
        self.assertEqual(status, 2)
        self.assertNotIn("restart", out.getvalue())

    def test_progress_is_what_the_chief_records_wherever_it_saves(self):
        # A command whose run folder the launcher could not work out from its flags (a GPU job
        # without --num_devices saves under mirrored_2_devices): the chief declares its folder
        # and commits what it saved there; a preemption after saving is restarted, not counted
        # as a failure, and the line names the folder the chief declared.
        model_dir = self.get_temp_dir()
        code = ("import os, sys\n"
                "from tfpar import worker_contract\n"
                "folder = os.path.join(sys.argv[1], 'mirrored_2_devices')\n"
                "done = os.path.exists(os.path.join(sys.argv[1], 'ran'))\n"
                "worker_contract.declare(folder=folder)\n"
                "if done: sys.exit(0)\n"
                "open(os.path.join(sys.argv[1], 'ran'), 'w').close()\n"
                "worker_contract.commit_position(folder, worker_contract.Position(1, 0))\n"
                "sys.exit(85)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code, model_dir,
                                  f"--model_dir={model_dir}"], 1, out=out, max_restarts=1,
                                 network="host")
        self.assertEqual(status, 0, out.getvalue())
        self.assertIn("launcher: the job was preempted after saving; starting every worker "
                      "again (not counted as a failure), resuming from epoch 1 in "
                      f"{os.path.join(model_dir, 'mirrored_2_devices')}.", out.getvalue())

    def test_a_rounds_progress_is_its_declared_folders_position_record(self):
        folder = self.get_temp_dir()
        first = Progress()  # Before the first round: nothing known.
        # A round whose chief declared nothing did not begin training: nothing moved.
        self.assertEqual(launcher.progress_of(None, first), Progress(recorded=False))
        spec = worker_contract.WorkerSpec(folder)
        worker_contract.commit_position(folder, worker_contract.Position(2, 3))
        # The first round: where it began is not known, so it made no progress it can show.
        after_first = launcher.progress_of(spec, first)
        self.assertEqual(after_first, Progress(None, (2, 3), folder))
        self.assertFalse(after_first.made)
        # The next round began where the first left the folder.
        worker_contract.commit_position(folder, worker_contract.Position(3, 0))
        after_second = launcher.progress_of(spec, after_first)
        self.assertEqual(after_second, Progress((2, 3), (3, 0), folder))
        self.assertTrue(after_second.made)
        self.assertFalse(launcher.progress_of(spec, after_second).made)  # Nothing new.
        self.assertEqual(launcher.progress_of(None, after_second),
                         Progress((3, 0), (3, 0), folder, recorded=False))

    def test_run_folders_is_deprecated(self):
        with self.assertWarnsRegex(DeprecationWarning, r"run_folders is deprecated and will be "
                                   r"removed in tfpar 0\.5\.0: .*worker_contract\.declare"):
            self.assertEqual(launcher.run_folders(["t.py", "--strategy=allreduce",
                                                   "--num_devices=1,2"]),
                             ["", "allreduce_1_devices", "allreduce_2_devices"])

    def test_cpu_workers_do_not_wait_for_the_hosts_gpus_to_be_listed(self):
        # --gpus_per_worker=0: nvidia-smi (up to 30 s, a notice waiting for it; a failure
        # line) and CUDA_VISIBLE_DEVICES (0,0 was refused) are not the job's; every worker
        # gets CUDA_VISIBLE_DEVICES empty, as before.
        out = io.StringIO()
        with mock.patch.object(launcher.gpus_lib, "gpu_listing",
                               side_effect=AssertionError("the host's GPUs were listed")), \
                mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "0,0"}):
            status = launcher.launch(
                [sys.executable, "-c",
                 "import os, sys; sys.exit(os.environ['CUDA_VISIBLE_DEVICES'] != '')"], 2,
                out=out, network="host", gpus_per_worker=0)
        self.assertEqual(status, 0, out.getvalue())

    def test_the_deprecated_flag_readers_read_as_the_workers_absl_flags_read(self):
        # The last of a repeated flag wins, one dash is a flag too, absl's --flagfile holds
        # flags in its place, and a wrapper's "--" is looked past.
        flagfile = os.path.join(self.get_temp_dir(), "job.flags")
        with open(flagfile, "w") as f:
            f.write("# The job's flags\n--model_dir=f\n--num_devices=2\n")
        with self.assertWarnsRegex(DeprecationWarning, r"model_dir_of is deprecated and will "
                                   r"be removed in tfpar 0\.5\.0: .*worker_contract\.declare"):
            self.assertEqual(launcher.model_dir_of(["python", "t.py", "--model_dir", "d"]), "d")
        with self.assertWarnsRegex(DeprecationWarning, r"flag_of is deprecated and will be "
                                   r"removed in tfpar 0\.5\.0: .*worker_contract\.declare"):
            self.assertEqual(launcher.flag_of(["python", "t.py", "--strategy=m"], "strategy"),
                             "m")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.assertIsNone(launcher.model_dir_of(["python", "t.py"]))
            self.assertEqual(launcher.model_dir_of(["t", "--model_dir=a", "--model_dir=b"]), "b")
            self.assertEqual(launcher.model_dir_of(["t", f"--flagfile={flagfile}"]), "f")
            self.assertEqual(launcher.model_dir_of(["t", "--flagfile", flagfile,
                                                    "--model_dir=g"]), "g")
            self.assertEqual(launcher.model_dir_of(["uv", "run", "--", "t", "-model_dir=c"]),
                             "c")

    def test_each_worker_gets_its_own_tf_config(self):
        configs = [json.loads(c) for c in launcher.tf_configs(3)]
        self.assertEqual([c["task"]["index"] for c in configs], [0, 1, 2])
        workers = configs[0]["cluster"]["worker"]
        self.assertLen(set(workers), 3)
        self.assertTrue(all(w.startswith("127.0.0.1:") for w in workers))

    def test_empty_command(self):
        with self.assertRaisesRegex(launcher.ConfigError, "The command to run is empty"):
            launcher.launch([], 2)

    def test_a_program_that_cannot_run(self):
        with self.assertRaisesRegex(launcher.ConfigError, r"Cannot run '/nonexistent': No such "
                                                          r"file or directory\. Give a program"):
            launcher.launch(["/nonexistent", "x"], 2)

    def test_a_host_that_is_not_this_machine(self):
        # In a network namespace of the test's own (loopback only): nothing can leave it.
        network = private_network.Namespace()
        self.addCleanup(network.close)
        code = ("import sys\nfrom tfpar.cluster import launcher\ntry:\n"
                "    launcher.launch([sys.executable, '-c', 'pass'], 2, host='10.255.255.1', "
                "network='host')\nexcept launcher.ConfigError as e:\n    print(e)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, preexec_fn=network.enter)
        self.assertRegex(result.stdout, r"Cannot open a port on host '10\.255\.255\.1' .*give "
                                        r"one of its addresses, e\.g\. 127\.0\.0\.1",
                         result.stderr[-2000:])

    def test_a_private_network_has_only_loopback(self):
        # Refused from the address alone, before any socket exists.
        with mock.patch.object(socket, "socket", side_effect=AssertionError("a socket")), \
                self.assertRaisesRegex(ConfigError, r"A private network has only loopback: "
                                                    r"host must be a loopback address .* "
                                                    r"Received: '10\.0\.0\.1'"):
            launcher.launch([sys.executable, "-c", "pass"], 2, host="10.0.0.1")

    def test_starts_again_with_new_ports_when_a_port_was_taken(self):
        marker = os.path.join(self.get_temp_dir(), "tried")
        code = ("import os, sys\n"
                f"marker = {marker!r} + os.environ['TF_CONFIG'][-3]\n"
                "if not os.path.exists(marker):\n"
                "    open(marker, 'w').close()\n"
                "    sys.exit(75)\n"
                "print('port', os.environ['TF_CONFIG'].split(':')[-3][:5], flush=True)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out, network="host")
        self.assertEqual(status, 0, out.getvalue())
        self.assertIn("launcher: a worker's port was taken by another program; starting again "
                      "with new ports (attempt 2 of 3).", out.getvalue())
        self.assertIn("listen on every network interface, unauthenticated", out.getvalue())

    def test_workers_listen_on_a_private_loopback_and_stop_on_sigterm(self):
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, os.path.join(HERE, "multi_worker_worker.py"), "serve"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        try:
            ready = {}
            for line in process.stdout:  # Event-driven: each worker says when it is in.
                match = re.match(r"\[worker (\d)\] ready (\d+) (\d+)", line)
                if match:
                    ready[match[1]] = (int(match[2]), int(match[3]))
                if len(ready) == 2:
                    break
            self.assertLen(ready, 2)
            pid, port = ready["1"]
            listening = re.compile(rf"^\s*\d+: [0-9A-F]+:{port:04X} [0-9A-F]+:0000 0A ", re.M)
            with open(f"/proc/{pid}/net/tcp6") as f6, open(f"/proc/{pid}/net/tcp") as f4:
                self.assertRegex(f6.read() + f4.read(), listening)  # Inside the job: listening.
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # Outside it: nothing there.
                with open(table) as f:
                    self.assertNotRegex(f.read(), listening)
            with open(f"/proc/{pid}/net/dev") as f:
                self.assertEqual([line.split(":")[0].strip() for line in f.readlines()[2:]], ["lo"])
            with self.assertRaises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            # TensorFlow's preemption notifier would swallow SIGTERM: the worker must stop.
            os.kill(pid, signal.SIGTERM)
            rest = process.communicate(timeout=60)[0]
        finally:
            process.kill()
        self.assertIn("launcher: worker 1 was killed by signal 15; stopped the other workers.",
                      rest)

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_workers_whose_replicas_do_not_divide_the_shards_refuse_in_one_line(self):
        # The launcher reads no flag of its workers: 2 workers of 2 devices cannot cut 2
        # shards, and the workers say so (exit 2, no restart, no traceback).
        process = train_job(2, self.get_temp_dir(), "--strategy=multi_worker_allreduce",
                            "--virtual_replicas=2", "--num_devices=2",
                            launcher_flags=("--max_restarts=1",))
        output = process.communicate(timeout=300)[0]
        self.assertEqual(process.returncode, 2, output[-3000:])
        self.assertIn("--virtual_replicas=2 needs a number of replicas that divides it (1, 2); "
                      "this job has 4.", output)
        self.assertNotIn("restart", output)
        self.assertNotIn("Traceback", output)

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_only_the_chief_reports(self):
        profile_dir = os.path.join(self.get_temp_dir(), "profile")
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--strategy=multi_worker",
             "--dataset=digits", "--epochs=1", "--batch_size=256", "--profile_steps=2,3",
             f"--profile_dir={profile_dir}"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertEqual(result.returncode, 0, result.stdout[-3000:])
        # The chief's trace only (TensorFlow's profiler aborts now and then in the others).
        self.assertEqual(re.findall(r"\[worker (\d)\] .*Profile of steps 2-3 written",
                                    result.stdout), ["0"])
        self.assertLen(tf.io.gfile.glob(os.path.join(profile_dir, "plugins", "profile", "*",
                                                     "*.xplane.pb")), 1)
        self.assertEqual(re.findall(r"\[worker (\d)\] test acc:", result.stdout), ["0"])
        self.assertEqual(re.findall(r"\[worker (\d)\] strategy +devices", result.stdout), ["0"])
        # Progress bars too: Keras's step counter appears on worker 0 only.
        self.assertNotRegex(result.stdout, r"\[worker 1\] .*\d+/\d+ ")
        self.assertNotIn("shuffle=True was passed", result.stdout)

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_a_hung_worker_ends_the_job_with_one_line_naming_it_and_a_restart_resumes(self):
        # SIGSTOP: the process lives but stops answering (a hung machine). TensorFlow's
        # coordination service misses its heartbeats for --heartbeat_timeout seconds (3 here;
        # TensorFlow's default, 10 s, measured 11 s) and aborts the collectives; worker 0
        # exits 69, and the launcher starts the job again from the last saved epoch.
        model_dir = os.path.join(self.get_temp_dir(), "state")
        process = train_job(2, model_dir, "--strategy=multi_worker", "--batch_size=256",
                            "--heartbeat_timeout=3", launcher_flags=("--max_restarts=1",))
        stopped = []
        try:
            stopped.append(signal_worker_after(process, "Saved training state after epoch 1 ",
                                               signal.SIGSTOP)[1])
            start, rest = time.monotonic(), []
            for line in process.stdout:  # Until worker 0 says why it stops.
                rest.append(line)
                if "[worker 0] Error:" in line:
                    break
            said_after = time.monotonic() - start
            rest = "".join(rest) + process.communicate(timeout=240)[0]
        finally:
            for pid in stopped:  # If the launcher has not ended it already.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            process.kill()
        self.assertEqual(process.returncode, 0, rest[-3000:])
        self.assertIn("launcher: worker 0 exited with 69 (worker 1 stopped answering); stopped the "
                      "other workers.", rest)
        self.assertRegex(rest, r"launcher: restart 1 of 1: starting every worker again, "
                               r"resuming from epoch [12] in ")
        self.assertEqual(worker_contract.read_position(
            os.path.join(model_dir, "multi_worker_1_devices")).epochs, 3)
        # Well before TensorFlow's own 10 s would have ended it: the option took effect.
        self.assertLess(said_after, 9)
        self.assertRegex(rest, r"\[worker 0\] Error: Worker 1 stopped answering, so TensorFlow "
                               r"aborted the job's collectives\. Check that every worker's process"
                               r" .* Epoch \d+ is the last saved in .*multi_worker_1_devices: run "
                               r"the same command on every worker to resume from it\.")
        self.assertNotIn("Traceback", rest)

    @parameterized.named_parameters(("lost", signal.SIGKILL), ("hung", signal.SIGSTOP))
    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_a_lost_or_hung_worker_among_8_ends_the_job_in_one_line_naming_it(self, signum):
        # 8 workers on 2 cores (one thread each). A killed worker is seen by the launcher at
        # once; a hung one (SIGSTOP) by its peers, whose coordination service misses its
        # heartbeats for --heartbeat_timeout seconds: whichever peer exits first names it.
        process = train_job(8, self.get_temp_dir(), "--strategy=multi_worker_allreduce",
                            "--batch_size=64", "--heartbeat_timeout=5")
        stopped = []
        try:
            stopped.append(signal_worker_after(process, "Saved training state after epoch 1 ",
                                               signum, num_workers=8)[1])
            start = time.monotonic()
            rest = process.communicate(timeout=240)[0]
            ended_after = time.monotonic() - start
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            process.kill()
        said = [line for line in rest.splitlines() if line.startswith("launcher:")]
        self.assertLen(said, 1, rest[-3000:])
        # A killed worker's peers may see its connections reset before the launcher polls it:
        # either way the one line names worker 7.
        lost = r"worker [0-6] exited with 69 \(worker 7 stopped answering\)"
        if signum == signal.SIGKILL:
            self.assertIn(process.returncode, (137, 69), rest[-3000:])
            self.assertRegex(said[0], rf"^launcher: (worker 7 was killed by signal 9|{lost}); "
                                      r"stopped the other workers\.$")
        else:
            self.assertEqual(process.returncode, 69, rest[-3000:])
            self.assertRegex(said[0], rf"^launcher: {lost}; stopped the other workers\.$")
            self.assertRegex(rest, r"\[worker [0-6]\] Error: Worker 7 stopped answering, so "
                                   r"TensorFlow aborted the job's collectives\.")
        # Bounded: the heartbeat timeout, the peers' exit and the launcher's stop of the rest,
        # long before a hang would end (the peers' 300 s wait); generous, for a loaded machine
        # running 8 workers on 2 cores.
        self.assertLess(ended_after, 150)
        self.assertNotIn("Traceback", rest)

    def test_the_script_answers_bad_input_with_one_line(self):
        for command, message in ((["--", "/nonexistent"], "Error: Cannot run '/nonexistent'"),
                                 ([], "Error: Give the command to run after '--'"),
                                 (["--max_restarts=1", "--num_workers=1", "--network=host",
                                   "--", sys.executable, os.path.join(ROOT, "scripts",
                                                                      "train.py")],
                                  "Error: The launcher starts this job again after a failure, "
                                  "from its last saved state: give --model_dir=DIR, where the "
                                  "state is saved."),
                                 # An empty folder is none; --noresume would start over.
                                 (["--max_restarts=1", "--num_workers=1", "--network=host",
                                   "--", sys.executable, os.path.join(ROOT, "scripts",
                                                                      "train.py"),
                                   "--model_dir="],
                                  "from its last saved state: give --model_dir=DIR, where the "
                                  "state is saved.\n"),
                                 (["--max_restarts=1", "--num_workers=1", "--network=host",
                                   "--", sys.executable, os.path.join(ROOT, "scripts",
                                                                      "train.py"),
                                   "--model_dir=/tmp/x", "--noresume"],
                                  "from its last saved state: drop --noresume.\n")):
            result = subprocess.run(
                [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), *command],
                capture_output=True, text=True, timeout=120)
            said = result.stderr + result.stdout  # A worker's lines come prefixed on stdout.
            self.assertEqual(result.returncode, 2, said)
            self.assertNotIn("Traceback", said)
            self.assertIn(message, said)


if __name__ == "__main__":
    tf.test.main()
