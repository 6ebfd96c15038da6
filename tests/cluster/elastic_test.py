"""Elastic jobs: a worker lost for good shrinks the job (down to its minimum) at the same global
batch, and the job grows back when the worker's machine returns; the results equal a job that
never lost a worker, within float summation order."""

import io
import os
import subprocess
import sys
from unittest import mock

import pytest
import quoted_output
import tensorflow as tf
from absl.testing import parameterized
from conftest import checkpoint_values

from tfpar import worker_contract
from tfpar.cluster import elastic
from tfpar.cluster import launcher
from tfpar.cluster.restart_policy import Action
from tfpar.cluster.restart_policy import JobState
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import Progress
from tfpar.cluster.restart_policy import RoundResult
from tfpar.cluster.restart_policy import decide
from tfpar.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
DIE = os.path.join(ROOT, "tests", "end_to_end", "train_and_die.py")
# A worker that declares its folder, reports its slot and rank, then fails (exit 3) after the
# seconds FAIL gives its slot ("1@1,3@3": slot 1 after 1 s, slot 3 after 3 s, one at a time),
# or succeeds after 6 s.
WORKER = """
import json, os, sys, time
from tfpar import worker_contract
worker_contract.declare(folder=sys.argv[1].split("=", 1)[1])  # Its --model_dir, as tfpar's do.
slot = int(os.environ["TFPAR_WORKER_SLOT"])
config = json.loads(os.environ["TF_CONFIG"])
print("slot", slot, "rank", config["task"]["index"], "of", len(config["cluster"]["worker"]),
      flush=True)
fail = dict(item.split("@") for item in os.environ["FAIL"].split(","))
if fail.get(str(slot)) == "0":  # A broken machine: fails at once.
    sys.exit(3)
if os.environ.get("VIRTUAL"):  # A world-size-invariant job's chief declares its shards,
    virtual = int(os.environ["VIRTUAL"])  # after a while, and every worker refuses a world
    time.sleep(float(os.environ.get("DECLARE_AFTER", 0)))  # size that does not divide them.
    worker_contract.declare(replicas_per_worker=1, virtual_replicas=virtual)
    if virtual % len(config["cluster"]["worker"]):
        sys.exit(2)
time.sleep(float(fail.get(str(slot), 6)))
sys.exit(3 if str(slot) in fail else 0)
"""


def launcher_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("launcher:")]


class WorkerRangeTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(("4", (4, 4)), (" 3:4 ", (3, 4)), (2, (2, 2)), ("1:8", (1, 8)))
    def test_a_number_or_a_range(self, text, expected):
        self.assertEqual(elastic.parse_worker_range(text), expected)

    @parameterized.parameters("0", "4:3", "0:2", "x", "2:", "1:2:3", "")
    def test_anything_else_is_refused_with_the_allowed_forms(self, text):
        with self.assertRaisesRegex(ConfigError, r"num_workers is a number of workers N or a "
                                                 r"range MIN:MAX with 1 <= MIN <= MAX, e\.g\. 4 "
                                                 r"or 3:4\. Received: "):
            elastic.parse_worker_range(text)

    def test_lost_slots_rejoin_on_trial_and_are_tried_further_apart_while_they_fail(self):
        slots = elastic.WorkerSlots(2, 4)
        self.assertEqual(slots.running, [0, 1, 2, 3])
        self.assertTrue(slots.can_lose(3))
        slots.lose(3, epochs_done=1)
        self.assertEqual((slots.running, slots.lost, slots.next_try_epochs), ([0, 1, 2], [3], 2))
        self.assertEqual(elastic.worker_words(2, slots.running), "worker 2")
        self.assertEqual(slots.rejoin(), [3])
        slots.lose(3, epochs_done=2)  # Failed again on rejoining: tried after 2 more epochs.
        self.assertEqual(slots.next_try_epochs, 4)
        slots.rejoin()
        slots.lose(3, epochs_done=4)
        self.assertEqual(slots.next_try_epochs, 8)
        slots.rejoin()
        slots.settled()  # It stayed: no longer on trial.
        slots.lose(0, epochs_done=9)
        self.assertEqual(slots.next_try_epochs, 10)
        self.assertEqual(elastic.worker_words(0, slots.running), "worker 0 (slot 1)")
        slots.lose(1, epochs_done=9)
        self.assertFalse(slots.can_lose(2))  # 2 is the minimum.
        self.assertFalse(elastic.WorkerSlots(4, 4).can_lose(3))  # Not elastic.


    def test_a_world_size_invariant_job_runs_only_with_sizes_its_shards_divide_into(self):
        # virtual_replicas=4 on 4 workers, at least 2: losing slot 1 leaves 3, so the highest
        # slot running is set aside too; both come back at the next try, only slot 1 on trial.
        spec = worker_contract.WorkerSpec(replicas_per_worker=1, virtual_replicas=4)
        self.assertEqual(spec.worker_counts(2, 4), (2, 4))
        self.assertIsNone(worker_contract.WorkerSpec(replicas_per_worker=1).worker_counts(2, 4))
        self.assertIsNone(worker_contract.WorkerSpec(virtual_replicas=4).worker_counts(2, 4))
        self.assertEqual(worker_contract.WorkerSpec(replicas_per_worker=2, virtual_replicas=8)
                         .worker_counts(1, 4), (1, 2, 4))
        self.assertEqual(spec.worker_counts(2, 3), (2,))  # 3 workers' replicas do not divide.
        slots = elastic.WorkerSlots(2, 4, sizes=(2, 4))
        self.assertTrue(slots.can_lose(1))
        slots.lose(1, epochs_done=1)
        self.assertEqual((slots.running, slots.lost, slots.set_aside), ([0, 2], [1, 3], [3]))
        self.assertFalse(slots.can_lose(2))  # 1 worker is below the minimum.
        self.assertEqual(slots.rejoin(), [1, 3])
        self.assertEqual((slots.running, slots.rejoining), ([0, 1, 2, 3], [1]))
        state = JobState(elastic.WorkerSlots(2, 4, sizes=(2, 4)), 0, 0, "/state")
        decision = decide(RoundResult(Outcome.FAILED, 137, 1), Progress((1, 0), (1, 0)), state)
        self.assertEqual(decision.state.slots.running, [0, 2])
        self.assertIn("slot 1 is lost and slot 3 set aside with it (the job runs with 4 or 2 "
                      "workers)", decision.line)
        # Shrunk to 3 before the sizes were known, then refused by the workers (exit 2): the
        # highest slot running is set aside, no restart used; no size left is an exit.
        shrunk = elastic.WorkerSlots(2, 4, running=[0, 1, 2], lost=[3], sizes=(2, 4))
        decision = decide(RoundResult(Outcome.FAILED, 2, 0), Progress((1, 0), (1, 0)),
                          JobState(shrunk, 1, 0, "/state"))
        self.assertEqual((decision.action, decision.state.slots.running,
                          decision.state.slots.set_aside, decision.state.failures),
                         (Action.START, [0, 1], [2], 0))
        self.assertEqual(shrunk.running, [0, 1, 2])  # Pure.
        gone = elastic.WorkerSlots(3, 4, running=[0, 1, 2], lost=[3], sizes=(2, 4))
        decision = decide(RoundResult(Outcome.FAILED, 2, 0), Progress((1, 0), (1, 0)),
                          JobState(gone, 1, 0, "/state"))
        self.assertEqual((decision.action, decision.status), (Action.EXIT, 2))


class ElasticLauncherTest(tf.test.TestCase):

    def launch(self, num_workers, min_workers, max_restarts=0, **env):
        model_dir = self.get_temp_dir()
        out = io.StringIO()
        with mock.patch.dict(os.environ, env):
            status = launcher.launch([sys.executable, "-c", WORKER, f"--model_dir={model_dir}"],
                                     num_workers, out=out, max_restarts=max_restarts,
                                     min_workers=min_workers)
        return status, out.getvalue(), model_dir

    def test_a_failing_slot_is_lost_rejoins_at_a_restart_and_the_job_stops_below_its_minimum(
            self):
        status, output, model_dir = self.launch(4, 3, max_restarts=1, FAIL="1@1,3@3")
        self.assertEqual(status, 3)
        scratch = f"resuming from what {model_dir} holds."
        self.assertEqual(launcher_lines(output), [
            "launcher: worker 1 exited with 3; stopped the other workers.",
            f"launcher: restart 1 of 1: starting every worker again, {scratch}",
            "launcher: worker 1 exited with 3; stopped the other workers.",
            "launcher: the restarts at 4 workers are used up (1 of 1): slot 1 is lost (tried "
            "again after epoch 1 or at a restart); going on with 3 workers of 4 (at least 3) at "
            f"the same global batch, {scratch}",
            "launcher: worker 2 (slot 3) exited with 3; stopped the other workers.",
            # The restart is the next chance of the lost slot.
            f"launcher: restart 1 of 1: starting every worker again with 4 workers, slot 1 "
            f"rejoining, {scratch}",
            "launcher: worker 1 exited with 3; stopped the other workers.",
            # Failing again before the job saved anything new is not counted as a restart.
            "launcher: slot 1 failed again on rejoining, so it is lost (tried again after epoch "
            f"2 or at a restart); going on with 3 workers of 4, {scratch}",
            "launcher: worker 2 (slot 3) exited with 3; stopped the other workers.",
            "launcher: the restarts at 3 workers are used up (1 of 1) and without slot 3 2 "
            "workers would be left, fewer than the minimum of 3; exiting with the failed "
            "worker's status (3)."])
        self.assertIn("[worker 2] slot 3 rank 2 of 3", output)

    def test_a_world_size_invariant_job_shrinks_to_a_size_its_chief_declared(self):
        # The chief declares 1 replica per worker and 4 shards: losing slot 1 of 4 leaves 3,
        # which do not divide them, so slot 3 is set aside too (the launcher read no flag).
        status, output, model_dir = self.launch(4, 2, FAIL="1@1", VIRTUAL="4")
        self.assertEqual(status, 0, output)
        self.assertEqual(launcher_lines(output)[1:], [
            "launcher: the restarts at 4 workers are used up (0 of 0): slot 1 is lost and slot "
            "3 set aside with it (the job runs with 4 or 2 workers) (tried again after epoch 1 "
            "or at a restart); going on with 2 workers of 4 (at least 2) at the same global "
            f"batch, resuming from what {model_dir} holds."])
        self.assertIn("[worker 1] slot 2 rank 1 of 2", output)

    def test_a_job_that_shrank_before_its_chief_declared_sets_slots_aside_when_refused(self):
        # Slot 3 fails at once, before the chief declared its shards: the launcher goes on
        # with 3, whose workers refuse (exit 2); the chief has declared by then, so slot 2 is
        # set aside, no restart used, and 2 workers finish.
        status, output, model_dir = self.launch(4, 2, FAIL="3@0", VIRTUAL="4",
                                                DECLARE_AFTER="3")
        self.assertEqual(status, 0, output)
        lines = launcher_lines(output)
        self.assertIn("going on with 3 workers of 4 (at least 2)", lines[1])
        self.assertEqual(lines[-1], "launcher: 3 workers cannot run the job (it runs with 4 or 2 "
                         "workers, its chief declared): slot 2 set aside; going on with 2 "
                         f"workers of 4, resuming from what {model_dir} holds.")

    def test_a_job_goes_on_with_the_workers_it_has_and_succeeds(self):
        status, output, model_dir = self.launch(3, 1, FAIL="0@1")
        self.assertEqual(status, 0, output)
        self.assertEqual(launcher_lines(output)[1:], [
            "launcher: the restarts at 3 workers are used up (0 of 0): slot 0 is lost (tried "
            "again after epoch 1 or at a restart); going on with 2 workers of 3 (at least 1) at "
            f"the same global batch, resuming from what {model_dir} holds."])
        # Slot 1 is the chief now.
        self.assertIn("[worker 0] slot 1 rank 0 of 2", output)
        self.assertIn("[worker 1] slot 2 rank 1 of 2", output)

    def test_the_worker_a_peer_says_stopped_answering_is_the_one_lost(self):
        # Worker 0 finds worker 2 stopped answering and exits as tfpar's programs do (69, its
        # stop record naming worker 2; no line needed, none racing its exit): the launcher
        # blames slot 2, not the messenger.
        code = ("import json, os, sys, time\n"
                "from tfpar import worker_contract\n"
                "slot = int(os.environ['TFPAR_WORKER_SLOT'])\n"
                "if slot == 0 and not os.path.exists(sys.argv[1]):\n"
                "    time.sleep(1)\n"
                "    open(sys.argv[1], 'w').close()\n"
                "    worker_contract.record_stop(69, 'Worker 2 stopped answering',\n"
                "                                unresponsive=[2])\n"
                "    sys.exit(69)\n"
                "time.sleep(0 if slot != 2 or os.path.exists(sys.argv[1]) else 30)\n")
        out = io.StringIO()
        model_dir = self.get_temp_dir()
        status = launcher.launch([sys.executable, "-c", code, os.path.join(model_dir, "said"),
                                  f"--model_dir={model_dir}"], 3, out=out, min_workers=2)
        self.assertEqual(status, 0, out.getvalue())
        lines = launcher_lines(out.getvalue())
        self.assertEqual(lines[0], "launcher: worker 0 exited with 69 (worker 2 stopped "
                                   "answering); stopped the other workers.")
        self.assertStartsWith(lines[1], "launcher: the restarts at 3 workers are used up (0 of "
                                        "0): slot 2 is lost")

    def test_bad_ranges_are_refused_and_an_elastic_job_is_told_it_restarts(self):
        with self.assertRaisesRegex(ConfigError, r"The fewest workers of an elastic job must be "
                                                 r"from 1 to num_workers \(2\)\. Received: "
                                                 r"min_workers=3\."):
            launcher.launch([sys.executable, "-c", "pass"], 2, min_workers=3)
        # An elastic job goes on from its saved state: its workers are told, as under restarts
        # (tfpar-train then refuses to run without --model_dir).
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", "import os; print('restarts:', "
                                  "os.environ['TFPAR_RESTARTS'])"], 2, out=out, min_workers=1,
                                 network="host", all_output=True)
        self.assertEqual(status, 0, out.getvalue())
        self.assertEqual(out.getvalue().count("restarts: 1"), 2, out.getvalue())

    def test_the_script_takes_a_range_and_answers_a_bad_one_in_one_line(self):
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=4:2",
             "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stderr.strip().splitlines()[-1],
                         "Error: --num_workers is a number of workers N or a range MIN:MAX with "
                         "1 <= MIN <= MAX, e.g. 4 or 3:4. Received: '4:2'.")
        model_dir = self.get_temp_dir()
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=1:2",
             "--", sys.executable, "-c", WORKER, f"--model_dir={model_dir}"],
            capture_output=True, text=True, timeout=120, env={**ENV, "FAIL": "1@0"})
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("slot 1 is lost", result.stdout)


# digits (1,437 training images) at a global batch of 48: 30 steps an epoch, at any number of
# workers (4: 12 examples each; 3: 16).
TRAIN_FLAGS = ("--strategy=multi_worker_allreduce", "--dataset=digits", "--epochs=4",
               "--batch_size=48", "--verbose=0", "--deterministic", "--seed=1")
RUN = "multi_worker_allreduce_1_devices"
_UNINTERRUPTED: dict = {}


def final_values(model_dir: str) -> dict:
    return checkpoint_values(os.path.join(model_dir, RUN))


@pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
class ElasticTrainingTest(tf.test.TestCase):

    def job(self, model_dir, num_workers, lose=None, on_line=lambda line: None):
        """Runs the 4-worker training job (the worker in slot ``lose[0]`` lost for good after
        epoch ``lose[1]``, its machine gone while the file ``lose[2]`` exists); returns the
        launcher's status and output."""
        train = [os.path.join(ROOT, "scripts", "train.py"), *TRAIN_FLAGS,
                 f"--model_dir={model_dir}"]
        if lose:
            train = [DIE, "slot", *map(str, lose), "--", *train]
        return self.run_job([sys.executable, os.path.join(ROOT, "scripts", "launch.py"),
                             f"--num_workers={num_workers}", "--", sys.executable, *train],
                            on_line)

    @staticmethod
    def run_job(command, on_line=lambda line: None):
        """Runs a launcher ``command``, each line of its output to ``on_line`` as it comes;
        returns its status and output."""
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=ENV)
        lines = []
        try:
            for line in process.stdout:
                lines.append(line)
                on_line(line)
            process.wait(timeout=400)
        finally:
            process.kill()
        return process.returncode, "".join(lines)

    def assertAsUninterrupted(self, model_dir):
        """The job's final model and optimizer state equal those of the 4-worker job run
        without a fault, within float summation order: 3 workers add a batch's gradients in
        another order than 4, and SGD carries that rounding along: after 60 steps at 3 workers
        (of 120) the largest difference measured 2.4e-3, and a 3-worker job from scratch is as
        far from the 4-worker one (1.4e-3 each after 30 steps). A lost or repeated step, or
        another global batch, moves weights by 1e-2 and more, and changes the step count."""
        if not _UNINTERRUPTED:
            reference = os.path.join(self.get_temp_dir(), "uninterrupted")
            status, output = self.job(reference, "4")
            self.assertEqual(status, 0, output[-3000:])
            _UNINTERRUPTED.update(final_values(reference))
        actual = final_values(model_dir)
        self.assertEqual(sorted(actual), sorted(_UNINTERRUPTED))
        self.assertGreater(len(actual), 5)
        for name, expected in _UNINTERRUPTED.items():
            if "iterations" in name:  # The same number of steps: the same global batch.
                self.assertEqual(expected, actual[name])
            self.assertAllClose(expected, actual[name], rtol=0, atol=6e-3, msg=name)

    def test_a_worker_lost_for_good_shrinks_the_job_to_3_at_the_same_global_batch(self):
        model_dir = os.path.join(self.get_temp_dir(), "shrunk")
        status, output = self.job(model_dir, "2:4",
                                  lose=(3, 2, os.path.join(self.get_temp_dir(), "gone")))
        self.assertEqual(status, 0, output[-3000:])
        # The launcher sees the kill, or a peer that saw the connection go says so first.
        self.assertRegex(output, r"launcher: (worker 3 was killed by signal 9|worker [0-2] exited "
                                 r"with 69 \(worker 3 stopped answering\)); stopped the other "
                                 r"workers\.")
        self.assertRegex(output, r"launcher: the restarts at 4 workers are used up \(0 of 0\): "
                                 r"slot 3 is lost \(tried again after epoch 3 or at a restart\); "
                                 r"going on with 3 workers of 4 \(at least 2\) at the same global "
                                 r"batch, resuming from epoch 2 in ")
        self.assertIn("(3 replicas), global batch 48", output)
        # At epoch 3's end the lost slot is tried again: a notice stops the workers within
        # epoch 4 (unless a fast machine ends the job first) and, its machine still gone, the
        # slot fails at once; the job goes on with 3 workers without using a restart.
        self.assertIn("launcher: epoch 3 is saved; a notice to every worker to save and stop, "
                      "to try the lost slots again.", output)
        if "launcher: growing back" in output:
            self.assertRegex(output, r"launcher: slot 3 failed again on rejoining, so it is lost "
                                     r"\(tried again after epoch 5 or at a restart\); going on "
                                     r"with 3 workers of 4, resuming from epoch 4( step \d+)? in ")
        self.assertAsUninterrupted(model_dir)

    def test_a_job_grows_back_when_the_lost_machine_returns(self):
        # The command and the lines the resume guide quotes (block elastic_grow_back), slot
        # 3's machine gone after epoch 1 and back once the slot is lost.
        model_dir = os.path.join(self.get_temp_dir(), "grown")
        gone = os.path.join(self.get_temp_dir(), "gone_for_a_while")

        def machine_returns(line):
            if "slot 3 is lost" in line:
                os.remove(gone)

        command = quoted_output.command("elastic_grow_back", {"/tmp/state": model_dir})
        train = next(i for i, word in enumerate(command) if word.endswith("train.py"))
        command[train:train] = [DIE, "slot", "3", "1", gone, "--"]
        status, output = self.run_job(command, machine_returns)
        self.assertEqual(status, 0, output[-3000:])
        quoted_output.assert_quoted("elastic_grow_back", output, {"/tmp/state": model_dir})
        self.assertIn("slot 3 is lost (tried again after epoch 2 or at a restart); going on with "
                      "3 workers of 4 (at least 3)", output)
        self.assertIn("launcher: epoch 2 is saved; a notice to every worker to save and stop, "
                      "to try the lost slots again.", output)
        self.assertRegex(output, r"launcher: growing back to 4 workers \(slot 3 rejoins\), "
                                 r"resuming from epoch 3( step \d+)? in ")
        self.assertIn("(4 replicas), global batch 48", output.rsplit("growing back", 1)[1])
        self.assertAsUninterrupted(model_dir)
