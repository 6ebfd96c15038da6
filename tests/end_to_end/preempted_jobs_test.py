"""Preemption of real jobs: a notice to one worker of a 2-worker job (or to the launcher, or to a
one-process run) stops every worker after the same step with the preempted status and one line
each; the rerun resumes at the next step and ends with the uninterrupted run's weights."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf
from absl.testing import parameterized
from conftest import checkpoint_values

from tfpar import worker_contract

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(ROOT, "scripts", "launch.py")
TRAIN = os.path.join(ROOT, "scripts", "train.py")
SIGNAL = os.path.join(HERE, "train_and_signal.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
PREEMPTED = 85
# digits (1,437 training images) at a global batch of 96: 15 steps an epoch.
FLAGS = ("--dataset=digits", "--epochs=3", "--batch_size=96", "--verbose=0")
_LINE = re.compile(r"^\[worker (\d)\] Preempted \(([^)]*)\): state saved at (epoch \d+ step \d+|"
                   r"the end of epoch \d+) in (\S+)(, ([\d.]+) s after the notice)?; run the same "
                   r"command to resume\.$", re.M)


def model_values(model_dir: str, run: str) -> dict:
    return checkpoint_values(os.path.join(model_dir, run))


_UNINTERRUPTED: dict = {}  # (strategy, flags) -> the final values of a job run without faults.


class PreemptionTestCase(tf.test.TestCase, parameterized.TestCase):

    def assertSameValues(self, expected: dict, actual: dict):
        self.assertEqual(sorted(expected), sorted(actual))
        self.assertGreater(len(expected), 5)
        for name in expected:
            self.assertAllClose(expected[name], actual[name], rtol=1e-6, atol=1e-7, msg=name)

    def uninterrupted(self, strategy, *flags) -> dict:
        """The final values of the job run without a notice (once per strategy and flags)."""
        if (strategy, flags) not in _UNINTERRUPTED:
            model_dir = os.path.join(self.get_temp_dir(), "uninterrupted")
            status, output = self.job(model_dir, strategy, *flags)
            self.assertEqual(status, 0, output[-3000:])
            _UNINTERRUPTED[strategy, flags] = model_values(model_dir, f"{strategy}_1_devices")
        return _UNINTERRUPTED[strategy, flags]

    def job(self, model_dir, strategy, *flags, signal_at=(), launcher_flags=(), timeout=300):
        """Runs a 2-worker job (its worker 1 signalling itself per ``signal_at``, the arguments
        of train_and_signal.py after RANK); returns the launcher's status and output."""
        train = [TRAIN, f"--strategy={strategy}", *FLAGS, f"--model_dir={model_dir}", *flags]
        if signal_at:
            train = [SIGNAL, "1", *map(str, signal_at), "--", *train]
        result = subprocess.run([sys.executable, LAUNCH, "--num_workers=2", *launcher_flags, "--",
                                 sys.executable, *train], capture_output=True, text=True,
                                env=ENV, timeout=timeout)
        return result.returncode, result.stdout + result.stderr


@pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
class JobPreemptionTest(PreemptionTestCase):

    @parameterized.named_parameters(
        ("sigterm_mid_epoch", "multi_worker", "SIGTERM", ("step", 2, 5), 1, "epoch 2 step 6"),
        ("sigusr1_two_steps_per_call", "multi_worker_allreduce", "SIGUSR1", ("step", 2, 4), 2,
         "epoch 2 step 6"),
        ("at_an_epochs_first_step", "multi_worker", "SIGTERM", ("step", 2, 0), 1,
         "epoch 2 step 2"),
        ("twice", "multi_worker", "SIGTERM", ("twice", 1, 7), 1, "epoch 1 step 8"),
        ("during_a_save", "multi_worker", "SIGUSR1", ("saving", 1, 0), 1, "epoch 2 step 2"),
        ("during_the_test_evaluation", "multi_worker", "SIGTERM", ("validation", 1, 0), 1,
         "epoch 2 step 2"))
    def test_a_notice_to_one_worker_stops_every_worker_after_the_same_step(
            self, strategy, name, signal_at, steps_per_execution, where):
        flags = (f"--steps_per_execution={steps_per_execution}",)
        parts = os.path.join(self.get_temp_dir(), "parts")
        status, output = self.job(parts, strategy, *flags, signal_at=(*signal_at, name))
        self.assertEqual(status, PREEMPTED, output[-3000:])
        lines = {int(m[1]): m for m in _LINE.finditer(output)}
        self.assertEqual(sorted(lines), [0, 1], output[-3000:])  # One line each.
        self.assertEqual(len(re.findall(r"\] Preempted", output)), 2, output[-3000:])
        self.assertEqual(lines[1][2], name)  # Worker 1 had the notice, worker 0 learned of it.
        self.assertEqual(lines[0][2], "a peer's notice")
        self.assertEqual({lines[0][3], lines[1][3]}, {where})  # The same step on both.
        self.assertLess(float(lines[1][6]), 25)  # Within the grace budget.
        self.assertNotIn("Traceback", output)
        self.assertIn("launcher: worker ", output)
        status, resumed = self.job(parts, strategy, *flags)
        self.assertEqual(status, 0, resumed[-3000:])
        self.assertRegex(resumed, rf"\[worker 0\] Resuming from .*ckpt-\d+ \({where}\)")
        self.assertSameValues(self.uninterrupted(strategy, *flags),
                              model_values(parts, f"{strategy}_1_devices"))

    def test_a_preempted_job_is_restarted_without_counting_a_failure(self):
        parts = os.path.join(self.get_temp_dir(), "parts")
        flags = ("--steps_per_execution=1",)
        status, output = self.job(parts, "multi_worker", *flags,
                                  signal_at=("step", 2, 3, "SIGTERM"),
                                  launcher_flags=("--max_restarts=1",))
        self.assertEqual(status, 0, output[-3000:])
        # Worker 1 had the notice; the chief leaves right after it, so either may be seen first.
        self.assertRegex(output, r"launcher: worker [01] stopped for a preemption notice "
                                 r"\(exit 85\); waiting for the others to save\.")
        self.assertIn("launcher: the job was preempted after saving; starting every worker "
                      "again (not counted as a failure), resuming from epoch 2 step 4 in "
                      f"{os.path.join(parts, 'multi_worker_1_devices')}.", output)
        self.assertNotIn("restart 1 of 1", output)
        self.assertSameValues(self.uninterrupted("multi_worker", *flags),
                              model_values(parts, "multi_worker_1_devices"))

    def test_a_workers_notice_whose_save_runs_out_of_grace_is_said_so(self):
        # Worker 1's notice; its saves then take 30 s, past a 3 s budget: it exits 85 with its
        # record saying the work is lost, and worker 0's save loses its peer. Neither the
        # launcher nor worker 0 may say otherwise ("preempted after saving", "Free space").
        parts = os.path.join(self.get_temp_dir(), "parts")
        status, output = self.job(parts, "multi_worker", "--preemption_grace_seconds=3",
                                  signal_at=("slow_save", 2, 30, "SIGTERM"))
        self.assertEqual(status, PREEMPTED, output[-3000:])
        self.assertIn("launcher: preempted; worker 1 could not save the notice's state within "
                      "the grace budget: a rerun resumes at epoch 1 in "
                      f"{os.path.join(parts, 'multi_worker_1_devices')}, and the training since "
                      "is lost.", output)
        self.assertIn("[worker 0] Error: Worker 1 stopped answering", output)
        self.assertNotIn("Free space there", output)
        self.assertNotIn("preempted after saving", output)

    def test_a_notice_to_the_launcher_is_passed_to_every_worker(self):
        model_dir = os.path.join(self.get_temp_dir(), "state")
        process = subprocess.Popen(
            [sys.executable, LAUNCH, "--num_workers=2", "--max_restarts=3", "--",
             sys.executable, TRAIN, "--strategy=multi_worker", "--dataset=digits",
             "--batch_size=96", "--epochs=1000", "--verbose=2", f"--model_dir={model_dir}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        try:
            seen = []
            for line in process.stdout:
                seen.append(line)
                if "Saved training state after epoch 1 " in line:
                    break
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)  # As Kubernetes or Slurm would.
            rest = process.communicate(timeout=120)[0]
            seconds = time.monotonic() - signalled
        finally:
            process.kill()
        self.assertEqual(process.returncode, PREEMPTED, rest[-3000:])
        self.assertLess(seconds, 35)
        self.assertIn("launcher: preemption notice; passed to every worker, waiting for them "
                      "to save.", rest)
        self.assertEqual(sorted(int(m[1]) for m in _LINE.finditer(rest)), [0, 1], rest[-3000:])
        self.assertRegex(rest, r"launcher: preempted; the workers exited with 85, the state "
                               r"saved at epoch \d+( step \d+)? in ")
        self.assertNotIn("restart", rest)  # The launcher itself is preempted: no restart.
        self.assertNotIn("Traceback", rest)


class ProcessPreemptionTest(PreemptionTestCase):
    """One process (two devices): the notice, the grace budget, the rerun."""

    def run_train(self, model_dir, *flags, signal_at=None, timeout=300, record=None):
        train = [TRAIN, "--strategy=mirrored", "--num_devices=2", *FLAGS,
                 f"--model_dir={model_dir}", *flags]
        if signal_at:
            train = [SIGNAL, "0", *map(str, signal_at), "--", *train]
        env = {**ENV, worker_contract.STOP_RECORD_ENV: record} if record else ENV
        return subprocess.run([sys.executable, *train], capture_output=True, text=True, env=env,
                              timeout=timeout)

    def test_a_notice_in_an_epochs_last_step_commits_the_epochs_end_before_exiting(self):
        # The stop is the epoch's end, whose save is written in the background: the process
        # must not exit (os._exit) before that write commits (it did, and lost the epoch).
        model_dir = self.get_temp_dir()
        stopped = self.run_train(model_dir, signal_at=("step", 1, 15, "SIGTERM"))  # Of 15.
        self.assertEqual(stopped.returncode, PREEMPTED, stopped.stderr[-3000:])
        self.assertRegex(stopped.stderr, r"(?m)^Preempted \(SIGTERM\): state saved at the end of "
                                         r"epoch 1 in ")
        position = worker_contract.read_position(os.path.join(model_dir, "mirrored_2_devices"))
        self.assertEqual((position.pair, position.checkpoint), ((1, 0), "ckpt-15"))
        resumed = self.run_train(model_dir)
        self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
        self.assertIn("(the end of epoch 1)", resumed.stdout)

    def test_a_notice_to_a_two_device_run_and_its_rerun(self):
        base = self.get_temp_dir()
        whole, parts = os.path.join(base, "whole"), os.path.join(base, "parts")
        self.assertEqual(self.run_train(whole).returncode, 0)
        record = os.path.join(base, "stop.json")
        stopped = self.run_train(parts, signal_at=("step", 2, 5, "SIGTERM"), record=record)
        self.assertEqual(stopped.returncode, PREEMPTED, stopped.stderr[-3000:])
        saved = worker_contract.StopRecord.read(record)
        self.assertEqual((saved.status, saved.work_lost), (PREEMPTED, False))
        self.assertEqual(worker_contract.read_position(
            os.path.join(parts, "mirrored_2_devices")).pair, (1, 5))
        # One process stops at the step boundary where the notice arrived.
        self.assertRegex(stopped.stderr, r"(?m)^Preempted \(SIGTERM\): state saved at epoch 2 "
                                         r"step 5 in .*mirrored_2_devices, [\d.]+ s after the "
                                         r"notice; run the same command to resume\.$")
        self.assertNotIn("Traceback", stopped.stderr)
        resumed = self.run_train(parts)
        self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
        self.assertIn("(epoch 2 step 5)", resumed.stdout)
        self.assertSameValues(model_values(whole, "mirrored_2_devices"),
                              model_values(parts, "mirrored_2_devices"))

    # Two runs and a rerun each: the long stage (the copies files' checks are unit-tested in
    # tests/replica_copies_test.py and tests/callbacks/checkpointing_test.py).
    # The mark under the parameters: absl copies it onto each generated test from there.
    @parameterized.parameters(
        ("deleted", "saved with this state is missing. ", "no such file."),
        ("cut", "is not readable. ", "BadZipFile: File is not a zip file."))
    @pytest.mark.cluster
    def test_a_rerun_with_a_replicas_copies_file_damaged_exits_2_naming_it(self, damage, what,
                                                                           received):
        # ResNet's per-replica BatchNorm: the state saved inside epoch 1 has the replicas' own
        # statistics in a file beside the checkpoint. Deleted, the rerun exited 0 having
        # resumed every replica from the first replica's statistics; cut short, it exited 1
        # with a traceback (which a launcher restarts until its restarts are spent).
        model_dir = self.get_temp_dir()
        flags = ("--model=resnet18", "--epochs=1")
        stopped = self.run_train(model_dir, *flags, signal_at=("step", 1, 1, "SIGTERM"))
        self.assertEqual(stopped.returncode, PREEMPTED, stopped.stderr[-3000:])
        copies = os.path.join(model_dir, "mirrored_2_devices", "replica_copies")
        (saved,) = os.listdir(copies)
        (name,) = os.listdir(os.path.join(copies, saved))
        path = os.path.join(copies, saved, name)
        if damage == "deleted":
            os.remove(path)
        else:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        rerun = self.run_train(model_dir, *flags)
        self.assertEqual(rerun.returncode, 2, rerun.stderr[-3000:])
        self.assertEqual(rerun.stderr.strip().splitlines()[-1],
                         f"Error: The replicas' copies file {path} {what}A restore reads each "
                         "file its save wrote, as written; start over (resume=False), or use "
                         f"another model_dir. Received: {received}")
        self.assertNotIn("Traceback", rerun.stderr)

    def test_a_save_past_the_grace_budget_keeps_the_last_complete_state(self):
        model_dir = self.get_temp_dir()
        # The notice in epoch 2; every save from then on takes 30 s, past a 3 s budget.
        record = os.path.join(self.get_temp_dir(), "stop.json")
        stopped = self.run_train(model_dir, "--preemption_grace_seconds=3",
                                 signal_at=("slow_save", 2, 30, "SIGTERM"), record=record)
        self.assertEqual(stopped.returncode, PREEMPTED, stopped.stderr[-3000:])
        # The same status (requeue the job), and the record says the work since is lost.
        lost = worker_contract.StopRecord.read(record)
        self.assertEqual((lost.status, lost.work_lost), (PREEMPTED, True))
        self.assertEqual(worker_contract.read_position(
            os.path.join(model_dir, "mirrored_2_devices")).pair, (1, 0))
        self.assertRegex(stopped.stderr, r"(?m)^Preempted \(SIGTERM\): the state could not be "
                                         r"saved within the 3 s grace budget; the end of epoch 1 "
                                         r"in .*mirrored_2_devices is intact and is where a rerun "
                                         r"resumes\.$")
        self.assertNotIn("Traceback", stopped.stderr)
        state = os.path.join(model_dir, "mirrored_2_devices")
        self.assertEqual(tf.train.get_checkpoint_state(state).model_checkpoint_path,
                         os.path.join(state, "ckpt-15"))  # Epoch 1's 15 steps.


if __name__ == "__main__":
    tf.test.main()
