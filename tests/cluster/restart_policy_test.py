"""The launcher's restart policy as a table: each path a job can take (the resume page's) is a row
of what happened, what was saved and the bookkeeping, and the decision with its line. No
processes; the whole table runs in milliseconds."""

import dataclasses
import time

from absl.testing import absltest
from absl.testing import parameterized

from tfpar.cluster import elastic
from tfpar.cluster.restart_policy import Action
from tfpar.cluster.restart_policy import JobState
from tfpar.cluster.restart_policy import Outcome
from tfpar.cluster.restart_policy import Progress
from tfpar.cluster.restart_policy import RoundResult
from tfpar.cluster.restart_policy import decide
from tfpar.cluster.restart_policy import growth_due
from tfpar.cluster.restart_policy import notice_status

DIR = "/state"
SAVED = Progress((1, 0), (2, 0), DIR)  # The round saved epoch 2.
NOTHING_NEW = Progress((2, 0), (2, 0), DIR)
FIRST_ROUND = Progress((0, 0), (0, 0), DIR)


def fixed(workers=2, max_restarts=0, failures=0, resumes_itself=False):
    return JobState(elastic.WorkerSlots(workers, workers), max_restarts, failures,
                    resumes_itself)


def elastic_job(minimum, maximum, max_restarts=0, failures=0, lost=(), rejoining=(),
                next_try=0):
    slots = elastic.WorkerSlots(minimum, maximum)
    slots.running = [s for s in range(maximum) if s not in lost]
    slots.lost, slots.rejoining = list(lost), list(rejoining)
    slots.next_try_epochs = next_try
    return JobState(slots, max_restarts, failures)


@dataclasses.dataclass
class Row:
    result: RoundResult
    progress: Progress
    state: JobState
    action: Action
    status: int
    line: str | None
    running: list | None = None  # The next round's slots.
    failures: int | None = None
    port_attempts: int | None = None


TABLE = {
    "every_worker_succeeded": Row(
        RoundResult(Outcome.SUCCEEDED), SAVED, fixed(max_restarts=2), Action.EXIT, 0, None),
    "a_failure_without_restarts_exits_with_its_status": Row(
        RoundResult(Outcome.FAILED, 137, 1), SAVED, fixed(), Action.EXIT, 137, None),
    "bad_input_is_never_restarted": Row(
        RoundResult(Outcome.FAILED, 2, 0), SAVED, fixed(max_restarts=3), Action.EXIT, 2, None),
    "a_failure_restarted": Row(
        RoundResult(Outcome.FAILED, 137, 1), SAVED, fixed(max_restarts=2), Action.START, 0,
        "launcher: restart 1 of 2: starting every worker again, resuming from epoch 2 in "
        "/state.", [0, 1], 1),
    "a_failure_restarted_from_scratch": Row(
        RoundResult(Outcome.FAILED, 1, 0), FIRST_ROUND, fixed(max_restarts=1), Action.START, 0,
        "launcher: restart 1 of 1: starting every worker again, from scratch (no epoch saved "
        "in /state yet).", [0, 1], 1),
    "a_failure_restarted_by_a_command_that_resumes_itself": Row(
        RoundResult(Outcome.FAILED, 1, 0), Progress(), fixed(max_restarts=1, resumes_itself=True),
        Action.START, 0, "launcher: restart 1 of 1: starting every worker again; the command "
        "resumes by itself.", [0, 1], 1),
    # A command whose chief declared no folder (a script saving nothing tfpar can see) starts
    # again as it is, and the line says so.
    "a_failure_restarted_from_scratch_where_no_folder_was_declared": Row(
        RoundResult(Outcome.FAILED, 1, 0), Progress(), fixed(max_restarts=1), Action.START, 0,
        "launcher: restart 1 of 1: starting every worker again, from scratch (no folder of "
        "saved state declared yet).", [0, 1], 1),
    "restarts_used_up": Row(
        RoundResult(Outcome.FAILED, 3, 0), SAVED, fixed(max_restarts=1, failures=1),
        Action.EXIT, 3, "launcher: restarts used up (1 of 1); exiting with the failed worker's "
        "status (3)."),
    "a_preemption_that_saved_is_not_counted": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1), Progress((1, 0), (1, 4), DIR),
        fixed(max_restarts=1, failures=1), Action.START, 0,
        "launcher: the job was preempted after saving; starting every worker again (not counted "
        "as a failure), resuming from epoch 2 step 4 in /state.", [0, 1], 1),
    # A worker's own notice, saved, not restarted: the last line says the status and where
    # the folder resumes (it was "worker 1 stopped for a preemption notice ...; waiting").
    "a_preemption_without_restarts_exits_85": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1), SAVED, fixed(), Action.EXIT, 85,
        "launcher: preempted; exiting with 85, the state saved at epoch 2 in /state."),
    "a_preemption_without_restarts_a_worker_killed_past_the_grace": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1, statuses=(137, 85)), SAVED, fixed(), Action.EXIT,
        85, "launcher: preempted; exiting with 85, the state saved at epoch 2 in /state "
            "(worker 0 exited with 137)."),
    "a_preemption_that_saved_nothing_counts_as_a_failure": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1), NOTHING_NEW, fixed(max_restarts=1), Action.START,
        0, "launcher: restart 1 of 1: starting every worker again, resuming from epoch 2 in "
        "/state.", [0, 1], 1),
    "a_notice_to_the_launcher": Row(
        RoundResult(Outcome.NOTICE, 85), Progress((2, 0), (2, 5), DIR), fixed(max_restarts=3),
        Action.EXIT, 85, "launcher: preempted; the workers exited with 85, the state saved at "
        "epoch 3 step 5 in /state."),
    "a_notice_to_the_launcher_whose_save_ran_out_of_grace": Row(
        RoundResult(Outcome.NOTICE, 85, work_lost=True), NOTHING_NEW, fixed(max_restarts=3),
        Action.EXIT, 85, "launcher: preempted; the workers exited with 85, but the notice's "
        "state could not be saved within the grace budget: a rerun resumes at epoch 2 in "
        "/state, and the training since is lost."),
    "a_notice_to_the_launcher_that_a_worker_ignored": Row(
        RoundResult(Outcome.NOTICE, 137, statuses=(85, 137)), NOTHING_NEW,
        fixed(max_restarts=3), Action.EXIT, 137,
        "launcher: preempted; the workers exited with 137 (killed past the grace budget): a "
        "rerun resumes at epoch 2 in /state, and the training since is lost."),
    # A user's script that saves with BackupAndRestore but does not watch for notices: the
    # notice's SIGTERM kills it during training, after its chief recorded progress, so its
    # 143 is its status, and the steps since its last save are lost.
    "a_notice_that_killed_a_script_during_training": Row(
        RoundResult(Outcome.NOTICE, 85, statuses=(143, 143)),
        Progress((0, 0), (0, 15), DIR),
        fixed(max_restarts=3), Action.EXIT, 143,
        "launcher: preempted; the workers exited with 143 (ended by the notice's SIGTERM "
        "without saving: the command does not save on a notice): a rerun resumes at epoch 1 "
        "step 15 in /state, and the training since is lost."),
    "a_notice_that_killed_a_script_before_its_first_save": Row(
        RoundResult(Outcome.NOTICE, 85, statuses=(143, 143)), FIRST_ROUND,
        fixed(max_restarts=3), Action.EXIT, 143,
        "launcher: preempted; the workers exited with 143 (ended by the notice's SIGTERM "
        "without saving: the command does not save on a notice): nothing was saved in /state "
        "yet, so a rerun starts from scratch."),
    # A user's own script that records no progress (plain Keras BackupAndRestore, no tfpar
    # strategy) keeps its signals: the notice's SIGTERM killed it at whatever step, so 143 is
    # its status, not 85 and "ended while starting, with nothing to save".
    "a_notice_that_killed_a_users_script_that_records_nothing": Row(
        RoundResult(Outcome.NOTICE, 85, statuses=(143,)), Progress(recorded=False),
        dataclasses.replace(fixed(workers=1), program=False), Action.EXIT, 143,
        "launcher: preempted; the workers exited with 143 (ended by the notice's SIGTERM "
        "without saving: the command does not save on a notice): the training since the last "
        "complete state is lost."),
    # A notice the launcher took while no worker ran (looking for GPUs, between rounds): no
    # worker exited with anything ("the workers exited with 85" was said).
    "a_notice_while_no_worker_ran": Row(
        RoundResult(Outcome.NOTICE, 85, workers_ran=False), Progress(recorded=False),
        fixed(max_restarts=3),
        Action.EXIT, 85, "launcher: preempted; exiting with 85: no worker was running."),
    "a_notice_between_rounds": Row(
        RoundResult(Outcome.NOTICE, 85, workers_ran=False),
        Progress((2, 0), (2, 0), DIR, recorded=False),
        fixed(max_restarts=3), Action.EXIT, 85,
        "launcher: preempted; exiting with 85, the state saved at epoch 2 in /state: no worker "
        "was running."),
    # The notice ended the workers before they began training (nothing recorded this round):
    # nothing was lost, and the line says their real status.
    "a_notice_while_the_workers_started": Row(
        RoundResult(Outcome.NOTICE, 85, statuses=(143, 85)),
        Progress((2, 0), (2, 0), DIR, recorded=False), fixed(max_restarts=3), Action.EXIT, 85,
        "launcher: preempted; exiting with 85, the state saved at epoch 2 in /state: worker 0 "
        "was ended by the notice while starting (exit 143), before it watched for notices, "
        "with nothing to save."),
    # One worker's own notice whose save ran out of grace: not "preempted after saving".
    "a_workers_notice_whose_save_ran_out_of_grace": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1, work_lost=True, statuses=(69, 85)),
        Progress((1, 0), (2, 0), DIR), fixed(max_restarts=1), Action.START, 0,
        "launcher: the job was preempted, but worker 1 could not save the notice's state "
        "within the grace budget (the training since the last save is lost); starting every "
        "worker again (not counted as a failure), resuming from epoch 2 in /state.", [0, 1],
        0),
    # Worker 1 was seen to stop first (its notice, saved in time); the chief's save of it ran
    # out of grace: the line names the worker whose record says so, not the first seen.
    "a_chiefs_save_ran_out_of_grace_after_a_peer_stopped": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1, work_lost=True, statuses=(85, 85), lost_by=(0,)),
        Progress((1, 0), (2, 0), DIR), fixed(), Action.EXIT, 85,
        "launcher: preempted; worker 0 could not save the notice's state within the grace "
        "budget: a rerun resumes at epoch 2 in /state, and the training since is lost."),
    "a_workers_notice_whose_save_ran_out_of_grace_without_restarts": Row(
        RoundResult(Outcome.PREEMPTED, 85, 1, work_lost=True, statuses=(69, 85)),
        Progress((1, 0), (2, 0), DIR), fixed(), Action.EXIT, 85,
        "launcher: preempted; worker 1 could not save the notice's state within the grace "
        "budget: a rerun resumes at epoch 2 in /state, and the training since is lost."),
    "ctrl_c": Row(
        RoundResult(Outcome.INTERRUPTED, 130), SAVED, fixed(max_restarts=3), Action.EXIT, 130,
        None),
    "a_slot_lost_when_its_restarts_are_used_up": Row(
        RoundResult(Outcome.FAILED, 137, 3), SAVED, elastic_job(2, 4, max_restarts=1,
                                                               failures=1),
        Action.START, 0, "launcher: the restarts at 4 workers are used up (1 of 1): slot 3 is "
        "lost (tried again after epoch 3 or at a restart); going on with 3 workers of 4 (at "
        "least 2) at the same global batch, resuming from epoch 2 in /state.", [0, 1, 2], 0),
    "the_slot_a_peer_blamed_is_the_one_lost": Row(
        RoundResult(Outcome.FAILED, 69, 0, unresponsive=(2,)), SAVED, elastic_job(2, 3),
        Action.START, 0,
        "launcher: the restarts at 3 workers are used up (0 of 0): slot 2 is lost (tried again "
        "after epoch 3 or at a restart); going on with 2 workers of 3 (at least 2) at the same "
        "global batch, resuming from epoch 2 in /state.", [0, 1], 0),
    "a_record_naming_a_peer_without_its_status_blames_the_failed_worker": Row(
        RoundResult(Outcome.FAILED, 1, 0, unresponsive=(2,)), SAVED, elastic_job(2, 3),
        Action.START, 0, "launcher: the restarts at 3 workers are used up (0 of 0): slot 0 is "
        "lost (tried again after epoch 3 or at a restart); going on with 2 workers of 3 (at "
        "least 2) at the same global batch, resuming from epoch 2 in /state.", [1, 2], 0),
    "a_port_taken_starts_again_with_new_ports_not_a_failure": Row(
        RoundResult(Outcome.FAILED, 75, 1), SAVED, fixed(max_restarts=1), Action.START, 0,
        "launcher: a worker's port was taken by another program; starting again with new "
        "ports (attempt 2 of 3).", [0, 1], 0, port_attempts=1),
    "a_port_taken_a_third_time_in_a_row_is_a_failure": Row(
        RoundResult(Outcome.FAILED, 75, 1), SAVED, dataclasses.replace(
            fixed(max_restarts=1), port_attempts=2), Action.START, 0,
        "launcher: restart 1 of 1: starting every worker again, resuming from epoch 2 in "
        "/state.", [0, 1], 1, port_attempts=0),
    "a_port_taken_a_third_time_without_restarts_exits": Row(
        RoundResult(Outcome.FAILED, 75, 0), SAVED, dataclasses.replace(
            fixed(), port_attempts=2), Action.EXIT, 75, None),
    "below_the_minimum": Row(
        RoundResult(Outcome.FAILED, 1, 1), SAVED, elastic_job(2, 3, max_restarts=1, failures=1,
                                                             lost=(2,), next_try=3),
        Action.EXIT, 1, "launcher: the restarts at 2 workers are used up (1 of 1) and without "
        "slot 1 1 worker would be left, fewer than the minimum of 2; exiting with the failed "
        "worker's status (1)."),
    "a_restart_lets_lost_slots_rejoin": Row(
        RoundResult(Outcome.FAILED, 1, 0), SAVED, elastic_job(2, 3, max_restarts=2, lost=(2,),
                                                             next_try=3),
        Action.START, 0, "launcher: restart 1 of 2: starting every worker again with 3 "
        "workers, slot 2 rejoining, resuming from epoch 2 in /state.", [0, 1, 2], 1),
    "a_rejoining_slot_that_fails_before_any_save_is_lost_again_free": Row(
        RoundResult(Outcome.FAILED, 1, 2), NOTHING_NEW, elastic_job(2, 3, max_restarts=1,
                                                                   rejoining=(2,)),
        Action.START, 0, "launcher: slot 2 failed again on rejoining, so it is lost (tried "
        "again after epoch 4 or at a restart); going on with 2 workers of 3, resuming from "
        "epoch 2 in /state.", [0, 1], 0),
    "growth_at_an_epoch_boundary": Row(
        RoundResult(Outcome.GROWING), Progress((2, 0), (3, 4), DIR),
        elastic_job(2, 4, max_restarts=1, failures=1, lost=(3,), next_try=3), Action.START, 0,
        "launcher: growing back to 4 workers (slot 3 rejoins), resuming from epoch 4 step 4 "
        "in /state.", [0, 1, 2, 3], 0),
    "a_preemption_lets_lost_slots_rejoin": Row(
        RoundResult(Outcome.PREEMPTED, 85, 0), SAVED, elastic_job(2, 3, lost=(1,), next_try=5),
        Action.START, 0, "launcher: the job was preempted after saving; starting every worker "
        "again (not counted as a failure) with 3 workers, slot 1 rejoining, resuming from "
        "epoch 2 in /state.", [0, 1, 2], 0),
}


class RestartPolicyTest(parameterized.TestCase):

    @parameterized.named_parameters((name, row) for name, row in TABLE.items())
    def test_row(self, row):
        before = dataclasses.replace(row.state)
        running_before = list(row.state.slots.running)
        decision = decide(row.result, row.progress, row.state)
        self.assertEqual((decision.action, decision.status, decision.line),
                         (row.action, row.status, row.line))
        if row.running is not None:
            self.assertEqual(decision.state.slots.running, row.running)
        if row.failures is not None:
            self.assertEqual(decision.state.failures, row.failures)
        if row.port_attempts is not None:
            self.assertEqual(decision.state.port_attempts, row.port_attempts)
        # Pure: the bookkeeping it was given is unchanged.
        self.assertEqual(row.state, before)
        self.assertEqual(row.state.slots.running, running_before)

    @parameterized.named_parameters(
        ("nothing_lost", Progress((1, 0), (3, 0)), (), 0, None),
        ("an_epoch_saved_at_the_next_try", Progress((1, 0), (3, 0)), (2,), 3, "epoch 3 is saved"),
        ("before_the_next_try", Progress((1, 0), (2, 0)), (2,), 3, None),
        ("nothing_saved_this_round", Progress((3, 0), (3, 0)), (2,), 3, None),
        ("inside_an_epoch_past_the_try", Progress((3, 0), (3, 7)), (2,), 3, None),
        ("no_record_yet", Progress(), (2,), 0, None))
    def test_when_a_shrunk_job_grows(self, progress, lost, next_try, expected):
        state = elastic_job(2, 3, lost=lost, next_try=next_try)
        self.assertEqual(growth_due(progress, state.slots), expected)

    def test_the_whole_table_takes_well_under_a_second(self):
        start = time.process_time()  # CPU time: a loaded machine does not count.
        for row in TABLE.values():
            decide(row.result, row.progress, row.state)
        self.assertLess(time.process_time() - start, 0.5)

    @parameterized.named_parameters(
        ("every_worker_saved", [85, 85], 85),
        ("one_saved_one_finished", [0, 85], 85),
        ("both_finished", [0, 0], 0),
        # Killed past the grace budget: the worst status, never 0 or a negative code's 247.
        ("both_ignored_the_notice", [137, 137], 137),
        ("one_exited_0_on_the_notice_and_one_was_killed", [0, 137], 137),
        # Still starting: the notice ended it before it watched for notices.
        ("one_still_starting", [85, 143], 85),
        # Training had begun (the chief recorded progress): the notice's SIGTERM killed it
        # mid-training without saving.
        ("one_killed_by_the_notice_during_training", [85, 143], 143, True),
        ("one_crashed", [85, 1], 1))
    def test_the_status_after_a_notice_to_the_launcher(self, statuses, expected, started=False):
        self.assertEqual(notice_status(statuses, started=started), expected)


if __name__ == "__main__":
    absltest.main()
