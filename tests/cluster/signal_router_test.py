"""The one home of signal handlers, on its own: handlers that only record, nested
subscriptions that give back what they replaced, and listeners told from the router's thread."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

from absl.testing import absltest

from tfpar import worker_contract
from tfpar.cluster import signal_router


class SignalRouterTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        signal_router.take()  # Nothing left from another test.
        self.addCleanup(signal_router.take)

    def test_a_subscription_records_and_gives_back_the_handlers_it_replaced(self):
        def mine(signum, frame):
            raise AssertionError("the subscription should have the signal")

        previous = signal.signal(signal.SIGUSR2, mine)
        self.addCleanup(signal.signal, signal.SIGUSR2, previous)
        self.assertTrue(signal_router.subscribe([signal.SIGUSR2]))
        try:
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)
            self.assertTrue(signal_router.pending())
            self.assertEqual(signal_router.take(), [signal.SIGUSR2, signal.SIGUSR2])
            self.assertFalse(signal_router.pending())
        finally:
            signal_router.unsubscribe()
        self.assertIs(signal.getsignal(signal.SIGUSR2), mine)

    def test_subscriptions_nest(self):
        previous = signal.getsignal(signal.SIGUSR2)
        signal_router.subscribe([signal.SIGUSR2])
        signal_router.subscribe([signal.SIGUSR2])
        signal_router.unsubscribe()
        self.assertIsNot(signal.getsignal(signal.SIGUSR2), previous)  # The outer one holds.
        signal_router.unsubscribe()
        self.assertIs(signal.getsignal(signal.SIGUSR2), previous)
        signal_router.unsubscribe()  # One too many: nothing to give back, no error.

    def test_take_one_kind_keeps_the_others(self):
        signal_router.subscribe([signal.SIGUSR1, signal.SIGUSR2])
        self.addCleanup(signal_router.unsubscribe)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        self.assertEqual(signal_router.take(only=signal.SIGUSR2), [signal.SIGUSR2])
        self.assertEqual(signal_router.take(), [signal.SIGUSR1])

    def test_a_listener_hears_of_an_arrival_from_the_routers_thread(self):
        heard = []
        arrived = threading.Event()

        def listener(signum):
            heard.append((signum, threading.current_thread().name))
            arrived.set()

        signal_router.on_arrival(listener)
        signal_router.subscribe([signal.SIGUSR2])
        self.addCleanup(signal_router.unsubscribe)
        os.kill(os.getpid(), signal.SIGUSR2)
        self.assertTrue(arrived.wait(10))
        self.assertIn((signal.SIGUSR2, "tfpar-signals"), heard)
        self.assertIsNotNone(signal_router.reader_descriptor())

    def test_install_sets_and_gives_back_and_is_the_only_caller_of_signal_signal(self):
        previous = signal_router.install({signal.SIGUSR2: signal.SIG_IGN})
        try:
            self.assertIs(signal.getsignal(signal.SIGUSR2), signal.SIG_IGN)
        finally:
            signal_router.install(previous)
        self.assertEqual(signal.getsignal(signal.SIGUSR2), previous[signal.SIGUSR2])
        package = os.path.dirname(os.path.dirname(signal_router.__file__))
        callers = []
        for folder, _, names in os.walk(package):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        if "signal.signal(" in f.read():
                            callers.append(os.path.relpath(path, package))
        self.assertEqual(callers, [os.path.join("cluster", "signal_router.py")])

    def test_off_the_main_thread_nothing_is_set(self):
        results = []
        worker = threading.Thread(target=lambda: results.append(
            signal_router.subscribe([signal.SIGUSR2])))
        worker.start()
        worker.join()
        self.assertEqual(results, [False])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EarlyNoticeTest(absltest.TestCase):
    """A program's notices are recorded from the moment ``import tfpar`` begins, before the
    program's own heavy imports, and become the notice once the program watches for them."""

    def setUp(self):
        super().setUp()
        self.folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.folder, True)

    def run_program(self, name: str, record: str) -> subprocess.CompletedProcess:
        """Runs a program file called ``name`` as a console script does (``from
        tfpar.cli.X import run``), with a notice right after tfpar's first line ran."""
        program, arguments = (("launch", '["--num_workers=1", "--", sys.executable, "-c", '
                                         '"pass"]') if name == "tfpar-launch"
                              else ("train", '["--dataset=digits", "--epochs=1"]'))
        path = os.path.join(self.folder, name)
        with open(path, "w") as f:
            f.write(textwrap.dedent(f"""
                import os, signal, sys
                import tfpar  # The first line of tfpar the program runs.
                os.kill(os.getpid(), signal.SIGTERM)  # Before tfpar.cli.{program} is imported.
                from tfpar.cli.{program} import run
                sys.argv[1:] = {arguments}
                run()
                """))
        return subprocess.run([sys.executable, path], capture_output=True, text=True,
                              timeout=300,
                              env={**os.environ, worker_contract.STOP_RECORD_ENV: record})

    def test_a_notice_while_a_program_imports_is_its_notice(self):
        for name in ("tfpar-train", "tfpar-launch"):
            record = os.path.join(self.folder, f"{name}.json")
            result = self.run_program(name, record)
            self.assertEqual(result.returncode, 85, result.stderr[-2000:])
            self.assertEqual(result.stderr.strip().splitlines()[-1],
                             "Preempted (SIGTERM) outside training: no training step had run "
                             "since the start, so nothing new was to be saved.")
            with open(record) as f:
                self.assertEqual(json.load(f)["status"], 85)

    def test_which_processes_are_tfpars_programs(self):
        python = "/usr/bin/python3"
        for argv, orig_argv, expected in (
                (["/venv/bin/tfpar-train"], [python, "/venv/bin/tfpar-train"], True),
                (["-m"], [python, "-X", "importtime", "-m", "tfpar.cli.launch"], True),
                (["-m"], [python, "-mtfpar.cli.env"], True),
                # Short options combined, as CPython reads them.
                (["-m"], [python, "-um", "tfpar.cli.train"], True),
                (["-m"], [python, "-Bum", "tfpar.cli.launch"], True),
                (["-m"], [python, "-uWignore", "-m", "tfpar.cli.train"], True),
                (["-m"], [python, "-uW", "ignore", "-m", "tfpar.cli.train"], True),
                (["-m"], [python, "-uXdev", "-mtfpar.cli.train"], True),
                (["-m"], [python, "-um", "pytest"], False),
                (["-c"], [python, "-uc", "import tfpar"], False),
                (["/venv/bin/tfpar-train"], [python, "-u", "/venv/bin/tfpar-train"], True),
                (["-m"], [python, "-m", "pytest", "tests"], False),
                (["-c"], [python, "-c", "import tfpar"], False),
                (["my.py"], [python, "my.py", "-m", "tfpar.cli.train"], False),
                ([os.path.join(ROOT, "scripts", "train.py")],
                 [python, os.path.join(ROOT, "scripts", "train.py")], True),
                (["scripts/train.py"], [python, "scripts/train.py"],
                 os.path.realpath("scripts/train.py")
                 == os.path.join(os.path.realpath(ROOT), "scripts", "train.py"))):
            self.assertEqual(signal_router.is_program(argv, orig_argv), expected,
                             (argv, orig_argv))

    def test_which_launched_commands_are_tfpars_programs(self):
        # The launcher's workers: a SIGTERM status after its notice means "still starting"
        # only for tfpar's programs; a user's own program keeps its signals.
        for command, expected in ((["tfpar-train", "--epochs=1"], True),
                                  (["/venv/bin/python3.11", "-um", "tfpar.cli.train"], True),
                                  (["python", "/venv/bin/tfpar-train"], True),
                                  (["python", "my_fit.py", "-m", "tfpar.cli.train"], False),
                                  (["python", "-c", "import tfpar"], False),
                                  (["bash", "-m", "tfpar.cli.train"], False),
                                  (["env", "A=1", "python3", "-m", "tfpar.cli.train"], True),
                                  (["uv", "run", "--", "tfpar-train", "--epochs=1"], True),
                                  (["python", "my.py", "--then", "tfpar-train"], False),
                                  ([], False)):
            self.assertEqual(signal_router.command_runs_program(command), expected, command)

    def test_a_program_of_the_users_importing_tfpar_keeps_its_own_signals(self):
        result = self.run_program("my_train.py",
                                  os.path.join(self.folder, "stop.json"))
        self.assertEqual(result.returncode, -signal.SIGTERM, result.stderr[-2000:])


if __name__ == "__main__":
    absltest.main()
