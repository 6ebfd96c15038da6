"""Tests of :class:`tfpar.cluster.preemption.Notice`: a process's notice from signal to exit."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from unittest import mock

import tensorflow as tf

from tfpar import worker_contract
from tfpar.cluster import preemption
from tfpar.cluster import signal_router


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


class NoticeTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.notice = preemption.Notice()

    def test_watching_subscribes_the_routers_handler_and_unwatching_gives_back(self):
        before = signal.getsignal(signal.SIGUSR2)
        self.assertTrue(self.notice.watch([signal.SIGUSR2], 5))
        self.assertTrue(self.notice.watching(signal.SIGUSR2))
        # The handler only records: it returns, and keeps nothing for a launcher's
        # signal_router.take() in this process; the next safe point knows of the notice.
        handler = signal.getsignal(signal.SIGUSR2)
        self.notice.loop_started()
        self.addCleanup(self.notice.loop_ended)
        self.addCleanup(self.notice.reset)
        self.assertIsNone(handler(signal.SIGUSR2, None))
        self.assertFalse(signal_router.pending())
        self.assertTrue(self.notice.arrived_at_step_boundary())
        self.assertEqual(self.notice.signal_name, "SIGUSR2")
        self.notice.reset()
        self.assertTrue(self.notice.watch([signal.SIGHUP], 7))  # Watches nest.
        self.assertFalse(self.notice.watching(signal.SIGUSR2))
        self.assertEqual(self.notice.seconds_left(), 7)
        self.notice.unwatch()
        self.assertTrue(self.notice.watching(signal.SIGUSR2))
        self.assertEqual(self.notice.seconds_left(), 5)
        self.notice.unwatch()
        self.assertFalse(self.notice.watching(signal.SIGUSR2))
        self.assertEqual(signal.getsignal(signal.SIGUSR2), before)

    def test_inside_training_an_arrival_only_records_and_starts_the_budget(self):
        self.notice.watch([signal.SIGUSR2], 30)
        self.addCleanup(self.notice.unwatch)
        self.addCleanup(self.notice.reset)  # Cancels the budget.
        self.notice.loop_started()
        self.addCleanup(self.notice.loop_ended)
        self.assertFalse(self.notice.has_arrived)
        self.assertEqual(self.notice.signal_name, "")
        self.assertEqual(self.notice.seconds_since(), 0)
        self.notice.arrive(signal.SIGUSR1)  # Not a notice here.
        self.assertFalse(self.notice.has_arrived)
        os.kill(os.getpid(), signal.SIGUSR2)  # Reaches arrive() from the router's thread.
        deadline = time.monotonic() + 10
        while not self.notice.has_arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(self.notice.has_arrived)
        self.assertEqual(self.notice.signal_name, "SIGUSR2")
        self.assertLess(self.notice.seconds_left(), 30)
        self.assertGreater(self.notice.seconds_left(), 20)
        self.notice.reset()
        self.assertFalse(self.notice.has_arrived)

    def test_a_routed_arrival_of_a_notice_taken_in_before_a_reset_is_not_a_new_one(self):
        # The handler records a notice; a loop takes it in at its step boundary, stops, and
        # the process goes on after reset() (a test, a notebook). The router's thread may
        # make the same signal's arrival only then: outside training a new notice would end
        # the process.
        self.notice.watch([signal.SIGUSR2], 30)
        self.addCleanup(self.notice.unwatch)
        self.addCleanup(self.notice.reset)
        with mock.patch.object(self.notice, "exit") as exit_, \
                mock.patch.object(self.notice, "announce_stop"):
            self.notice._record(signal.SIGUSR2, sys._getframe())  # The signal's handler.
            self.notice.loop_started()
            self.assertTrue(self.notice.arrived_at_step_boundary())
            self.notice.loop_ended()
            self.notice.reset()
            self.notice._routed_arrival(signal.SIGUSR2)  # Late: the notice taken in.
            self.assertFalse(self.notice.has_arrived)
            exit_.assert_not_called()
            # A notice after the reset is one: outside training it ends the process.
            self.notice._record(signal.SIGUSR2, sys._getframe())
            self.notice._routed_arrival(signal.SIGUSR2)
            self.assertTrue(self.notice.has_arrived)
            exit_.assert_called_once()

    def test_a_stop_step_of_one_process_is_the_step_at_the_notice(self):
        self.notice.watch([signal.SIGUSR2], 30)
        self.addCleanup(self.notice.unwatch)
        self.addCleanup(self.notice.reset)
        self.notice.loop_started()
        self.addCleanup(self.notice.loop_ended)
        stop = self.notice.stop_step("run")
        self.assertIsNone(stop.stop_after(3))
        self.notice.arrive(signal.SIGUSR2)
        self.assertEqual(stop.stop_after(4), 4)
        self.assertEqual(stop.stop_after(5), 4)

    def test_off_the_main_thread_nothing_is_watched(self):
        result = []
        thread = threading.Thread(target=lambda: result.append(
            self.notice.watch([signal.SIGUSR2], 5)))
        thread.start()
        thread.join()
        self.assertEqual(result, [False])
        self.assertFalse(self.notice.watching(signal.SIGUSR2))

    def test_the_modules_functions_warn_and_name_the_notices_member(self):
        for old, new in [("watch_signals", "watch"), ("noticed", "arrived_at_step_boundary"),
                         ("notice_name", "signal_name"), ("stopping", "announce_stop"),
                         ("exit_now", "exit"), ("exits_process", "exits_process"),
                         ("training", "loop_started() and NOTICE.loop_ended()")]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                getattr(preemption, old)
            self.assertLen(caught, 1)
            self.assertIs(caught[0].category, DeprecationWarning)
            self.assertIn(f"use tfpar.cluster.preemption.NOTICE.{new}", str(caught[0].message))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertFalse(preemption.noticed())  # Still answers, as a function.
        with self.assertRaises(AttributeError):
            preemption.no_such_name  # noqa: B018


class NoticeProcessTest(tf.test.TestCase):
    """Whole processes: how a notice ends them, and what they record."""

    def test_outside_training_a_notice_ends_the_process_at_once_with_its_record(self):
        record = os.path.join(self.get_temp_dir(), "stop.json")
        result = run("""
            import os, signal, time
            import tensorflow as tf
            from tfpar import worker_contract
            from tfpar.cluster import preemption
            preemption.NOTICE.watch([signal.SIGTERM], 20)
            worker_contract.commit_position("/runs/x", worker_contract.Position(1, 3),
                                            write=False)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # Ended from the router's thread, not after this.
            print("not reached")
            """, **{worker_contract.STOP_RECORD_ENV: record})
        self.assertEqual(result.returncode, preemption.PREEMPTED_EXIT_STATUS, result.stderr)
        self.assertNotIn("not reached", result.stdout)
        self.assertNotIn("Traceback", result.stderr)
        line = ("Preempted (SIGTERM) outside training: epoch 2 step 3 in /runs/x is where a "
                "rerun resumes.")
        self.assertEqual(result.stderr.strip().splitlines()[-1], line)
        with open(record) as f:
            stop = json.load(f)
        self.assertEqual(stop["status"], preemption.PREEMPTED_EXIT_STATUS)
        self.assertEqual(stop["reason"], line)

    def test_a_spent_budget_ends_the_process_and_says_the_work_is_lost(self):
        record = os.path.join(self.get_temp_dir(), "stop.json")
        result = run("""
            import os, signal, time
            import tensorflow as tf
            from tfpar import worker_contract
            from tfpar.cluster import preemption
            preemption.NOTICE.watch([signal.SIGUSR1], 0.2)
            preemption.NOTICE.loop_started()  # A loop that never reaches its step boundary.
            worker_contract.commit_position("/runs/x", worker_contract.Position(1, 0),
                                            write=False)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(30)
            """, **{worker_contract.STOP_RECORD_ENV: record})
        self.assertEqual(result.returncode, preemption.PREEMPTED_EXIT_STATUS, result.stderr)
        self.assertIn("Preempted (SIGUSR1): the state could not be saved within the 0.2 s grace "
                      "budget; the end of epoch 1 in /runs/x is intact and is where a rerun "
                      "resumes.", result.stderr)
        with open(record) as f:
            self.assertTrue(json.load(f)["work_lost"])


    def test_a_budget_spent_after_the_notices_state_was_committed_lost_nothing(self):
        # The notice's state (epoch 2 step 3) was committed; the budget ran out while old
        # copies were being pruned. The record names that state, and no work was lost.
        record = os.path.join(self.get_temp_dir(), "stop.json")
        result = run("""
            import os, signal, time
            import tensorflow as tf
            from tfpar import worker_contract
            from tfpar.cluster import preemption
            preemption.NOTICE.watch([signal.SIGUSR1], 0.2)
            preemption.NOTICE.loop_started()
            worker_contract.commit_position("/runs/x", worker_contract.Position(1, 0),
                                            write=False)
            os.kill(os.getpid(), signal.SIGUSR1)
            preemption.NOTICE.stop_at((1, 3))  # The step the job agreed on.
            worker_contract.commit_position("/runs/x", worker_contract.Position(1, 3),
                                            write=False)  # Its commit.
            time.sleep(30)  # Pruning, past the budget.
            """, **{worker_contract.STOP_RECORD_ENV: record})
        self.assertEqual(result.returncode, preemption.PREEMPTED_EXIT_STATUS, result.stderr)
        self.assertIn("Preempted (SIGUSR1): the notice's state was saved (epoch 2 step 3 in "
                      "/runs/x, where a rerun resumes); the 0.2 s grace budget ran out as the "
                      "process ended, with nothing lost.", result.stderr)
        with open(record) as f:
            stop = json.load(f)
        self.assertFalse(stop["work_lost"])

    def notice_during_a_slow_save(self, owner: str, name: str) -> tuple[dict, str]:
        """Saves epoch 1, then takes a notice (a 1 s budget) and saves the notice's state
        (epoch 2 step 3) in a child process whose ``owner.name`` (an expression and a member,
        a step of the save) takes 1.5 s; returns its stop record and the state folder."""
        record = os.path.join(self.get_temp_dir(), "stop.json")
        directory = os.path.join(self.get_temp_dir(), "state")
        result = run(f"""
            import os, signal, time
            import tensorflow as tf
            from tfpar import testing
            from tfpar.callbacks import checkpointing
            from tfpar.cluster import preemption
            model = testing.tiny_model()
            checkpoint = checkpointing.EpochCheckpoint(
                {directory!r}, model, tf.distribute.get_strategy())
            checkpoint.set_model(model)
            checkpoint.on_epoch_end(0, {{"loss": 1.5}})  # Epoch 1, as the launcher knows,
            checkpoint.wait()  # committed (written in the background) before the notice.
            step = {owner}.{name}

            def slow_step(*args, **kwargs):
                time.sleep(1.5)  # Past the budget.
                return step(*args, **kwargs)

            {owner}.{name} = slow_step
            preemption.NOTICE.watch([signal.SIGUSR1], 1.0)
            preemption.NOTICE.loop_started()
            os.kill(os.getpid(), signal.SIGUSR1)
            preemption.NOTICE.stop_at((1, 3))  # The step the job agreed on.
            checkpoint.save_inside_epoch(1, 3)
            time.sleep(30)  # Pruning, past the budget.
            """, **{worker_contract.STOP_RECORD_ENV: record})
        self.assertEqual(result.returncode, preemption.PREEMPTED_EXIT_STATUS, result.stderr)
        with open(record) as f:
            return json.load(f), directory

    def test_a_budget_spent_while_a_commits_position_is_recorded_waits_for_it(self):
        # The notice's state (epoch 2 step 3) is committed by TensorFlow; the budget runs out
        # while the chief writes its position record (a slow disk). Before, the process ended
        # between the two: its stop line said epoch 2 step 3, nothing lost, and the record the
        # launcher reads still epoch 1, the line it prints.
        stop, directory = self.notice_during_a_slow_save("checkpointing.worker_contract",
                                                         "commit_position")
        self.assertFalse(stop["work_lost"], stop)
        self.assertIn(f"the notice's state was saved (epoch 2 step 3 in {directory}, ",
                      stop["reason"])
        self.assertEqual(worker_contract.read_position(directory).pair, (1, 3))

    def test_a_budget_spent_during_tensorflows_commit_names_both_states(self):
        # The budget runs out while TensorFlow writes the notice's state (its index, then a
        # sweep of old checkpoints, on slow storage): whether the folder holds it is not known
        # until its position record, so the line names both, and the work as maybe lost.
        stop, directory = self.notice_during_a_slow_save("checkpoint._manager", "save")
        self.assertTrue(stop["work_lost"], stop)
        self.assertEqual(stop["reason"], (
            "Preempted (SIGUSR1): the state could not be saved within the 1 s grace budget; "
            f"the save of epoch 2 step 3 in {directory} was under way, so a rerun resumes "
            f"there if it committed, else at the end of epoch 1 in {directory}."))


class LauncherHandOverTest(tf.test.TestCase):

    def test_a_launcher_takes_over_its_programs_notices_and_their_budget(self):
        # A launcher program watches notices from its first instant; once it launches, its
        # notices are passed on to the workers, and its own grace budget (0.2 s here) must not
        # end it while the workers save (1.5 s here).
        code = """
            import signal, sys, threading, os, time
            from tfpar.cluster import launcher, preemption
            preemption.NOTICE.watch([signal.SIGTERM], 0.2, exit_process=True)
            worker = ("import signal, sys, time\\n"
                      "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(85)))\\n"
                      "print('up', flush=True)\\n"
                      "time.sleep(60)\\n")
            class Out:
                def write(self, text):
                    sys.stdout.write(text)
                    if "up" in text:
                        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
                def flush(self):
                    sys.stdout.flush()
            sys.exit(launcher.launch([sys.executable, "-c", worker], 1, out=Out()))
            """
        result = run(code)
        self.assertEqual(result.returncode, preemption.PREEMPTED_EXIT_STATUS,
                         result.stdout + result.stderr)
        self.assertIn("launcher: preempted; the workers exited with 85.", result.stdout)
        self.assertNotIn("grace budget", result.stdout + result.stderr)
