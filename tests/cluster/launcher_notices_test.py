"""Tests of :mod:`tfpar.cluster.launcher` at the edges of its supervision: the status after a
notice, a notice at any moment (between two rounds, while workers start), a second notice inside
a worker, and each local worker's own GPUs (emulated: a list of GPUs given to the launcher)."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import gpus
from tfpar.cluster import launcher
from tfpar.cluster import worker_group
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import RoundResult
from tfpar.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH = os.path.join(ROOT, "scripts", "launch.py")


def launcher_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("launcher:")]


def assert_launch_refuses(test: tf.test.TestCase, flags: list[str], visible: str,
                          line: str) -> None:
    """Asserts ``tfpar-launch FLAGS -- python -c pass`` with ``CUDA_VISIBLE_DEVICES=visible``
    exits 2 with ``line`` alone."""
    result = subprocess.run([sys.executable, LAUNCH, *flags, "--", sys.executable, "-c", "pass"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
    test.assertEqual(result.returncode, 2, result.stderr)
    test.assertEqual(result.stderr.strip(), line)


def notice_once_up(test: tf.test.TestCase, code_and_args: list[str]) -> tuple[int, str]:
    """Runs ``tfpar-launch --num_workers=2 -- python -c CODE ARGS``, sends the launcher a
    notice once both workers printed "up", and returns its status and output."""
    launch = subprocess.Popen(
        [sys.executable, LAUNCH, "--num_workers=2", "--", sys.executable, "-c", *code_and_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    test.addCleanup(launch.kill)
    for _ in range(2):
        test.assertIn("up", launch.stdout.readline())
    launch.send_signal(signal.SIGTERM)
    output = launch.communicate(timeout=120)[0]
    return launch.returncode, output


class NoticeStatusTest(tf.test.TestCase, parameterized.TestCase):
    """A notice to the launcher ends it with 85 only when every worker saved; else the worst
    normalised status, never 0 nor a negative return code's 247."""

    @parameterized.named_parameters(
        # Neither takes the notice: both killed after the grace.
        ("both_ignore_it", "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)", 137),
        # Worker 0 leaves with 0 (it did not finish), worker 1 is killed.
        ("one_exits_0_one_ignores_it", "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))",
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)", 137),
        # Both stop as tfpar's programs do after saving.
        ("both_save", "signal.signal(signal.SIGTERM, lambda *_: sys.exit(85))",
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(85))", 85))
    def test_the_status_after_a_notice_to_the_launcher(self, worker_0, worker_1, expected):
        code = textwrap.dedent(f"""
            import os, signal, sys, time
            if os.environ["TFPAR_WORKER_SLOT"] == "0":
                {worker_0}
            else:
                {worker_1}
            print("up", flush=True)
            time.sleep(60)
            """)
        # The grace is read by the launcher: its own is 10.5 s.
        returncode, output = notice_once_up(self, [code, "--preemption_grace_seconds=0.5"])
        self.assertEqual(returncode, expected, output)
        said = ("" if expected == 85 else " (killed past the grace budget): the training "
                "since the last complete state is lost")
        self.assertIn(f"launcher: preempted; the workers exited with {expected}{said}.", output)
        self.assertNotIn("Traceback", output)


    def test_a_notice_that_kills_a_script_during_training_is_said_with_its_status(self):
        # A user's script that saves (its chief declared its folder and committed epoch 1
        # step 15 there, as BackupAndRestore under tfpar does) but does not watch for
        # notices: the notice's SIGTERM kills it during training. Its status is 143, not the
        # preempted one, and the line says where the folder resumes and that the steps since
        # are lost.
        state = os.path.join(self.get_temp_dir(), "state")
        code = textwrap.dedent("""
            import os, sys, time
            from tfpar import worker_contract
            if os.environ["TFPAR_WORKER_SLOT"] == "0":
                worker_contract.declare(folder=sys.argv[1])
                worker_contract.commit_position(sys.argv[1], worker_contract.Position(0, 15))
            print("up", flush=True)
            time.sleep(60)
            """)
        returncode, output = notice_once_up(self, [code, state])
        self.assertEqual(returncode, 143, output)
        self.assertEqual(launcher_lines(output)[-1],
                         "launcher: preempted; the workers exited with 143 (ended by the "
                         "notice's SIGTERM without saving: the command does not save on a "
                         "notice): a rerun resumes at epoch 1 step 15 in "
                         f"{state}, and the training since is lost.")


class NoticeAtAnyMomentTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        # Under code that lets a notice reach this process outside the launcher's handlers,
        # the test fails here rather than ending the test process.
        previous = signal.signal(signal.SIGTERM, self._escaped)
        self.addCleanup(signal.signal, signal.SIGTERM, previous)

    @staticmethod
    def _escaped(signum, frame):
        raise AssertionError("the notice reached a handler outside the launcher")

    def test_a_notice_between_two_rounds_exits_85_in_one_line(self):
        rounds = []

        model_dir = self.get_temp_dir()

        def failed_then_noticed(group):
            rounds.append(group.slots)
            # Its chief declared its folder (as tfpar's savers do when they restore).
            with open(group.worker_spec, "w") as f:
                json.dump({"folder": model_dir}, f)
            os.kill(os.getpid(), signal.SIGTERM)  # While no worker runs.
            return RoundResult(Outcome.FAILED, 1, 0)

        out = io.StringIO()
        with mock.patch.object(worker_group.WorkerGroup, "run", failed_then_noticed):
            status = launcher.launch([sys.executable, "-c", "pass"], 2, out=out,
                                     max_restarts=3)
        self.assertEqual(status, 85, out.getvalue())
        self.assertLen(rounds, 1)  # No second round started.
        self.assertEqual(launcher_lines(out.getvalue()), [
            "launcher: restart 1 of 3: starting every worker again, resuming from what "
            f"{model_dir} holds.",
            "launcher: preemption notice while no worker was running; the saved state is where "
            "a rerun resumes.",
            "launcher: preempted; exiting with 85: no worker was running."])

    def test_a_notice_while_the_launcher_looks_for_gpus_exits_85_before_any_worker(self):
        def slow_nvidia_smi(environ):
            os.kill(os.getpid(), signal.SIGTERM)  # nvidia-smi can take seconds to answer.
            return [], None

        out = io.StringIO()
        with mock.patch.object(launcher.gpus_lib, "gpu_listing", slow_nvidia_smi), \
                mock.patch.object(worker_group.WorkerGroup, "run") as run:
            status = launcher.launch([sys.executable, "-c", "pass"], 2, out=out)
        self.assertEqual(status, 85, out.getvalue())
        run.assert_not_called()
        self.assertEqual(launcher_lines(out.getvalue())[0],
                         "launcher: preemption notice while no worker was running; the saved "
                         "state is where a rerun resumes.")

    def test_a_notice_while_the_workers_start_stops_them_and_exits_85(self):
        start = worker_group.WorkerGroup._start

        def start_then_notice(group, *args):
            processes = start(group, *args)
            os.kill(os.getpid(), signal.SIGTERM)  # Before any of them watches for notices.
            return processes

        # A stand-in for tfpar's program (named as its console script), which watches for
        # notices from its first import of tfpar: its SIGTERM status is its start-up's. (A
        # user's own program keeps its signals: its 143 is its status, at any moment.)
        program = os.path.join(self.get_temp_dir(), "tfpar-train")
        with open(program, "w") as f:
            f.write("import time\ntime.sleep(60)\n")
        out = io.StringIO()
        began = time.monotonic()
        with mock.patch.object(worker_group.WorkerGroup, "_start", start_then_notice):
            status = launcher.launch([sys.executable, program], 2, out=out)
        self.assertEqual(status, 85, out.getvalue())
        self.assertLess(time.monotonic() - began, 50)  # Not the workers' 60 s.
        self.assertEqual(launcher_lines(out.getvalue()), [
            "launcher: preemption notice; passed to every worker, waiting for them to save.",
            "launcher: preempted; exiting with 85: worker 0 and worker 1 were ended by the "
            "notice while starting (exit 143), before they watched for notices, with nothing "
            "to save."])

    def test_a_notice_that_kills_a_users_program_says_its_status(self):
        start = worker_group.WorkerGroup._start

        def start_then_notice(group, *args):
            processes = start(group, *args)
            time.sleep(2)  # Under way, as a user's script training without saving on notices.
            os.kill(os.getpid(), signal.SIGTERM)
            return processes

        out = io.StringIO()
        with mock.patch.object(worker_group.WorkerGroup, "_start", start_then_notice):
            status = launcher.launch([sys.executable, "-c", "import time; time.sleep(60)"], 2,
                                     out=out)
        self.assertEqual(status, 143, out.getvalue())
        self.assertEqual(launcher_lines(out.getvalue())[-1],
                         "launcher: preempted; the workers exited with 143 (ended by the "
                         "notice's SIGTERM without saving: the command does not save on a "
                         "notice): the training since the last complete state is lost.")


class SecondNoticeTest(tf.test.TestCase):

    def test_a_notice_while_the_notices_are_being_reset_never_blocks(self):
        # The main thread holds the notice's lock (as reset() does) when a notice arrives: the
        # handler that interrupts it must not wait for that lock (it only records), and the
        # notice is handled once the lock is free.
        code = textwrap.dedent("""
            import os, signal, time
            from tfpar.cluster import preemption
            preemption.NOTICE.watch([signal.SIGTERM], 20)
            with preemption.NOTICE._lock:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # The handler runs here, between two bytecodes.
                    pass
            time.sleep(30)
            """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60)
        # Outside training a notice stops the process at once, with the preempted status.
        self.assertEqual(result.returncode, 85, result.stderr)
        self.assertIn("Preempted (SIGTERM) outside training", result.stderr)


def failing_nvidia_smi(directory: str) -> str:
    """An ``nvidia-smi`` in ``directory/bin`` that fails, as one whose driver does not answer."""
    path = os.path.join(directory, "bin", "nvidia-smi")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version "
                "mismatch' >&2\nexit 1\n")
    os.chmod(path, 0o755)
    return path


def driver_listing(directory: str, count: int) -> str:
    """A stand-in for the driver's /proc listing of ``count`` GPUs, in ``directory``."""
    driver = os.path.join(directory, f"driver{count}")
    for i in range(count):
        os.makedirs(os.path.join(driver, f"0000:{17 + i:02x}:00.0"))
    return driver


class GpusPerWorkerTest(tf.test.TestCase, parameterized.TestCase):
    """Emulated GPUs: each worker prints the CUDA_VISIBLE_DEVICES it was given."""

    SHOW = ("import os; print('gpus', os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), "
            "flush=True)")

    def given(self, num_workers, **kwargs):
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", self.SHOW], num_workers, out=out,
                                 **kwargs)
        self.assertEqual(status, 0, out.getvalue())
        seen = {}
        for line in out.getvalue().splitlines():
            if "] gpus " in line:
                seen[int(line.split("]")[0].split()[-1])] = line.split("gpus ", 1)[1]
        return seen, launcher_lines(out.getvalue())

    @parameterized.named_parameters(
        ("two_workers_on_4_gpus", 2, {}, {0: "0,1", 1: "2,3"}),
        ("four_workers_on_4_gpus", 4, {}, {0: "0", 1: "1", 2: "2", 3: "3"}),
        ("one_gpu_each_asked", 2, {"gpus_per_worker": 1}, {0: "0", 1: "1"}),
        ("none_asked", 2, {"gpus_per_worker": 0}, {0: "", 1: ""}))
    def test_each_worker_gets_its_own_share(self, num_workers, kwargs, expected):
        seen, _ = self.given(num_workers, gpus=["0", "1", "2", "3"], **kwargs)
        self.assertEqual(seen, expected)

    def test_gpus_left_idle_are_said_in_one_line(self):
        seen, lines = self.given(3, gpus=["0", "1", "2", "3"])
        self.assertEqual(seen, {0: "0", 1: "1", 2: "2"})
        self.assertIn("launcher: 4 GPUs among 3 workers: 1 each; GPU 3 left idle (set "
                      "gpus_per_worker to choose).", lines)

    def test_a_cpu_host_gives_no_gpus(self):
        seen, _ = self.given(2, gpus=[])
        self.assertEqual(seen, {0: "unset", 1: "unset"})

    def test_a_failing_nvidia_smi_leaves_the_drivers_gpus_and_a_line(self):
        smi = failing_nvidia_smi(self.get_temp_dir())
        driver = driver_listing(self.get_temp_dir(), 2)
        with mock.patch.dict(os.environ, {"PATH": f"{os.path.dirname(smi)}:"
                                                  f"{os.environ['PATH']}"}), \
                mock.patch.object(gpus, "DRIVER_GPUS", driver):
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            seen, lines = self.given(2)
        self.assertEqual(seen, {0: "0", 1: "1"})
        self.assertIn("launcher: nvidia-smi failed (exit status 1: Failed to initialize NVML: "
                      "Driver/library version mismatch); counting the GPUs the driver lists in "
                      f"{driver} instead: 2.", lines)

    def test_more_workers_than_gpus_is_refused_in_one_line(self):
        with self.assertRaisesRegex(ConfigError, r"^5 workers of 1 GPU each need 5 GPUs; this "
                                                 r"host shows 4 .* set gpus_per_worker=0 to run "
                                                 r"them on the CPU\.$"):
            launcher.launch([sys.executable, "-c", "pass"], 5, gpus=["0", "1", "2", "3"])
        assert_launch_refuses(
            self, ["--num_workers=3", "--gpus_per_worker=2"], "0,1,2,3",
            "Error: 3 workers of 2 GPU each need 6 GPUs; this host shows 4 "
            "(CUDA_VISIBLE_DEVICES, nvidia-smi or the driver's list). Run fewer "
            "workers, or set --gpus_per_worker=0 to run them on the CPU.")


MIG_LISTING = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5a1c)
  MIG 3g.20gb     Device  0: (UUID: MIG-aaaa-0000)
  MIG 3g.20gb     Device  1: (UUID: MIG-aaaa-0001)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-77e2)
"""


class GpuListingTest(tf.test.TestCase):
    """The GPUs a host shows: CUDA_VISIBLE_DEVICES, nvidia-smi, the driver's list, MIG."""

    def test_without_nvidia_smi_the_drivers_list_counts(self):
        driver = self.get_temp_dir()
        for address in ("0000:17:00.0", "0000:65:00.0"):
            os.makedirs(os.path.join(driver, address))
        self.assertEqual(gpus.visible_gpus({}, which=lambda _: None, driver_gpus=driver),
                         ["0", "1"])
        self.assertEqual(gpus.visible_gpus({}, which=lambda _: None,
                                           driver_gpus=os.path.join(driver, "none")), [])
        self.assertEqual(gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}, which=lambda _: None,
                                           driver_gpus=driver), ["3"])

    def test_a_failing_nvidia_smi_falls_back_to_the_drivers_list_and_says_so(self):
        smi = failing_nvidia_smi(self.get_temp_dir())
        driver = driver_listing(self.get_temp_dir(), 2)
        listed, note = gpus.gpu_listing({}, which=lambda _: smi, driver_gpus=driver)
        self.assertEqual(listed, ["0", "1"])
        self.assertEqual(note, "nvidia-smi failed (exit status 1: Failed to initialize NVML: "
                               "Driver/library version mismatch); counting the GPUs the driver "
                               f"lists in {driver} instead: 2.")
        self.assertEqual(gpus.visible_gpus({}, which=lambda _: smi, driver_gpus=driver),
                         ["0", "1"])
        none = os.path.join(driver, "missing")
        self.assertEqual(gpus.gpu_listing({}, which=lambda _: smi, driver_gpus=none), (
            [], "nvidia-smi failed (exit status 1: Failed to initialize NVML: Driver/library "
                f"version mismatch), and the driver lists no GPU in {none}: no GPU is given."))

    def test_an_nvidia_smi_ended_by_a_signal_is_said_so(self):
        # A scheduler's SIGTERM to the launcher's process group ends nvidia-smi too: not an
        # "exit status -15".
        path = os.path.join(self.get_temp_dir(), "bin", "nvidia-smi")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("#!/bin/sh\nkill -TERM $$\n")
        os.chmod(path, 0o755)
        none = os.path.join(self.get_temp_dir(), "missing")
        self.assertEqual(gpus.gpu_listing({}, which=lambda _: path, driver_gpus=none)[1],
                         "nvidia-smi failed (ended by signal 15, as by a notice or Ctrl-C to "
                         "the launcher's process group), and the driver lists no GPU in "
                         f"{none}: no GPU is given.")

    def test_a_gpu_listed_twice_is_refused_in_one_line(self):
        with self.assertRaisesRegex(ConfigError, re.escape(
                "CUDA_VISIBLE_DEVICES lists GPU 0 more than once, so workers would share it. "
                "List each GPU once. Received: CUDA_VISIBLE_DEVICES='0,0'.")):
            gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,0"})
        # Spelled another way, it is the same GPU to CUDA (00,0 was given whole to a worker).
        for visible in ("00,0", "1, 0,01"):
            with self.assertRaisesRegex(ConfigError, "more than once", msg=visible):
                gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": visible})
        assert_launch_refuses(
            self, ["--num_workers=2"], "0,0",
            "Error: CUDA_VISIBLE_DEVICES lists GPU 0 more than once, so workers "
            "would share it. List each GPU once. Received: CUDA_VISIBLE_DEVICES='0,0'.")

    def test_mig_instances_are_listed_by_uuid_one_per_worker(self):
        listed = gpus.listed_gpus(MIG_LISTING)
        self.assertEqual(listed, ["MIG-aaaa-0000", "MIG-aaaa-0001", "1"])
        given, idle = gpus.shares(listed, 3)
        self.assertEqual(given, {0: "MIG-aaaa-0000", 1: "MIG-aaaa-0001", 2: "1"})
        self.assertIsNone(idle)
        with self.assertRaisesRegex(ConfigError, r"^These GPUs are MIG instances, and CUDA "
                                                 r"shows a process one MIG instance at most"):
            gpus.shares(["MIG-a", "MIG-b", "MIG-c", "MIG-d"], 2)


if __name__ == "__main__":
    tf.test.main()
