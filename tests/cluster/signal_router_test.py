"""The one home of signal handlers, on its own: handlers that only record, nested
subscriptions that give back what they replaced, and listeners told from the router's thread."""

import os
import signal
import threading

from absl.testing import absltest

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


if __name__ == "__main__":
    absltest.main()
