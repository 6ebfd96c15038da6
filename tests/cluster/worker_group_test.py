"""Tests of one round of workers on its own (``WorkerGroup``): what each way a round ends
reports, the environment each worker gets, and its stop record read after it exited."""

import io
import json
import os
import sys
from unittest import mock

import tensorflow as tf

from tfpar.cluster import worker_group
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import RoundResult
from tfpar.errors import ExitStatus

# Each worker runs this with its rank's behaviour in argv ("0": succeed, "3": exit 3, ...).
PROGRAM = """
import json, os, sys, time
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print("slot", os.environ["TFPAR_WORKER_SLOT"], "rank", rank,
      "spec", os.environ.get("TFPAR_WORKER_SPEC") or "-", flush=True)
action = sys.argv[1 + rank]
if action == "sleep":
    time.sleep(60)
if action == "blame1":  # Says worker 1 stopped answering, as tfpar's programs do.
    from tfpar import worker_contract
    worker_contract.record_stop(69, "Worker 1 stopped answering", unresponsive=(1,))
    sys.exit(69)
if action == "lost85":  # Its notice's save ran out of grace, as tfpar's programs record it.
    from tfpar import worker_contract
    worker_contract.record_stop(85, "Preempted (SIGTERM): the state could not be saved",
                                work_lost=True)
    sys.exit(85)
if action == "69later":  # A peer that finds the preempted worker gone.
    time.sleep(3)
    sys.exit(69)
sys.exit(int(action) if action.isdigit() else 0)
"""


class WorkerGroupTest(tf.test.TestCase):

    def run_round(self, *actions: str, slots=None, spec=None) -> tuple[RoundResult, str]:
        out = io.StringIO()
        group = worker_group.WorkerGroup(
            [sys.executable, "-c", PROGRAM, *actions], slots or list(range(len(actions))),
            "127.0.0.1", out, all_output=True, network="host", grace=5.0,
            worker_spec=spec)
        return group.run(), out.getvalue()

    def test_every_worker_succeeding(self):
        result, output = self.run_round("0", "0")
        self.assertEqual(result, RoundResult(Outcome.SUCCEEDED, 0, 0))
        self.assertIn("[worker 1] slot 1 rank 1 spec -", output)  # Each worker's slot, rank.

    def test_after_a_notice_the_workers_get_the_grace_budget_their_chief_declared(self):
        spec = os.path.join(self.get_temp_dir(), "declared.json")
        group = worker_group.WorkerGroup(["t"], [0], "127.0.0.1", io.StringIO(), False, "host",
                                         grace=130.0, worker_spec=spec, grace_margin=10.0)
        self.assertEqual(group._notice_grace(), 130.0)  # Nothing declared: the default.
        with open(spec, "w", encoding="utf-8") as f:
            json.dump({"grace_seconds": 3}, f)
        self.assertEqual(group._notice_grace(), 13.0)

    def test_only_the_chief_is_asked_for_the_worker_spec(self):
        # Not the others, even where the launcher's own environment names one (a launcher
        # under a launcher).
        spec = os.path.join(self.get_temp_dir(), "spec.json")
        with mock.patch.dict(os.environ, {"TFPAR_WORKER_SPEC": "/elsewhere.json"}):
            _, output = self.run_round("0", "0", spec=spec)
        self.assertIn(f"[worker 0] slot 0 rank 0 spec {spec}", output)
        self.assertIn("[worker 1] slot 1 rank 1 spec -", output)

    def test_a_failing_worker_is_the_one_reported_and_the_others_are_stopped(self):
        result, output = self.run_round("sleep", "3")
        self.assertEqual((result.outcome, result.status, result.rank), (Outcome.FAILED, 3, 1))
        self.assertIn("launcher: worker 1 exited with 3; stopped the other workers.", output)

    def test_the_worker_a_stop_record_names_is_reported_and_blamed(self):
        result, output = self.run_round("blame1", "sleep")
        self.assertEqual((result.outcome, result.status, result.rank, result.unresponsive),
                         (Outcome.FAILED, 69, 0, (1,)))
        self.assertEqual(result.blamed, 1)
        self.assertIn("launcher: worker 0 exited with 69 (worker 1 stopped answering); stopped "
                      "the other workers.", output)

    def test_a_taken_port_is_reported_not_retried(self):
        # New ports are the restart policy's decision; the round only reports the status.
        result, output = self.run_round("75", "sleep")
        self.assertEqual((result.outcome, result.status, result.rank), (Outcome.FAILED, 75, 0))
        self.assertEqual(output.count("listen on every network interface"), 1)

    def test_a_preempted_worker_leaves_the_others_to_finish(self):
        result, _ = self.run_round(str(int(ExitStatus.PREEMPTED)), "0")
        self.assertEqual((result.outcome, result.status), (Outcome.PREEMPTED, 85))

    def test_a_preempted_workers_record_and_its_peers_statuses_are_read(self):
        # Worker 1's notice: its save ran out of grace (its stop record says the work is
        # lost); worker 0 then finds it gone. The round reports both, not a clean preemption.
        result, output = self.run_round("69later", "lost85")
        self.assertEqual(result, RoundResult(Outcome.PREEMPTED, 85, 1, work_lost=True,
                                             statuses=(69, 85), lost_by=(1,)))
        self.assertIn("launcher: worker 1 stopped for a preemption notice (exit 85); waiting "
                      "for the others to save.", output)

    def test_slots_and_ranks_differ_after_a_loss(self):
        _, output = self.run_round("0", "0", slots=[0, 2])
        self.assertIn("[worker 1] slot 2 rank 1 spec -", output)  # No record asked.


if __name__ == "__main__":
    tf.test.main()
