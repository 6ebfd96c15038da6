"""The peers of a multi-worker job: waiting until they are up (saying whom it waits for),
connecting TensorFlow's strategy to them, and the chief leaving last. No TensorFlow at import.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING

from absl import logging

from tfpar import worker_contract
from tfpar.cluster import signal_router
from tfpar.cluster.spec import is_chief
from tfpar.cluster.spec import is_multi_worker
from tfpar.cluster.spec import split_address
from tfpar.errors import ClusterError
from tfpar.errors import PeerUnreachableError
from tfpar.errors import PortTakenError

if TYPE_CHECKING:  # Imported where used: the command line reads this module's constants.
    import tensorflow as tf

COUNT_WAIT_SECONDS = 60.0
"""How long a worker waits, at most, for its connected peers' counts (see
:func:`counts_of_every_worker`)."""
DEFAULT_TIMEOUT_SECONDS = 300.0
"""How long a worker waits for its peers by default before it gives up."""
REPORT_EVERY_SECONDS = 5.0
"""How often a waiting worker says whom it waits for."""
FIRST_REPORT_SECONDS = 1.0
"""When a waiting worker first says whom it waits for."""

# What a waiting task's port answers with: any first bytes tell a peer it is up. Once the task
# has started TensorFlow's server, that server answers instead (gRPC's HTTP/2 SETTINGS frame,
# sent as soon as a connection opens).
_GREETING = b"tfpar worker waiting for its peers\n"
_CONNECT_SECONDS = 0.5
_ANSWER_SECONDS = 1.0


def _answers(address: str) -> bool:
    """Whether a task listens at ``address`` and answers: a connection alone is not enough,
    since a firewall, a proxy or a program that never accepts can complete the handshake."""
    try:
        with socket.create_connection(split_address(address), timeout=_CONNECT_SECONDS) as probe:
            probe.settimeout(_ANSWER_SECONDS)
            return bool(probe.recv(1))
    except OSError:
        return False


def wait_for_peers(cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver,
                   timeout: float = DEFAULT_TIMEOUT_SECONDS,
                   report: Callable[[str], None] = logging.warning,
                   report_every: float = REPORT_EVERY_SECONDS) -> None:
    """Waits until every other task of the cluster is up, saying what it waits for.

    TensorFlow's own wait for the cluster (inside the strategy's constructor) is silent,
    endless, and deaf to SIGTERM and Ctrl-C. This one runs first, in Python: it holds this
    task's port (so the peers see it is up, and a port already taken is found at once), polls
    the peers' ports, reports which are missing after a second and then every
    ``report_every`` seconds, and gives up after ``timeout``. A signal interrupts it like any
    Python code.

    Args:
        cluster_resolver: The cluster, with this task's type and index.
        timeout: Seconds to wait for the peers before giving up.
        report: Called with each "waiting for ..." message.
        report_every: Seconds between messages.

    Raises:
        PortTakenError: If this task's port is in use by another program.
        PeerUnreachableError: If a peer is not up after ``timeout`` seconds.
    """
    spec = cluster_resolver.cluster_spec()
    me = (cluster_resolver.task_type, cluster_resolver.task_id)
    tasks = {(job, index): spec.task_address(job, index)
             for job in spec.jobs for index in spec.task_indices(job)}
    own = tasks.pop(me, None)
    if own is None or not tasks:
        return
    with _held_port(own, me[0]) as listener:
        missing = dict(sorted(tasks.items()))
        start, since = time.monotonic(), time.strftime("%H:%M:%S")
        next_report = start + min(FIRST_REPORT_SECONDS, report_every)
        while True:
            _greet_probes(listener)
            missing = {task: address for task, address in missing.items()
                       if not _answers(address)}
            if not missing:
                return
            waited = time.monotonic() - start
            names = ", ".join(f"{job} {index} ({address})"
                              for (job, index), address in missing.items())
            if waited > timeout:
                raise PeerUnreachableError(
                    f"{names[0].upper()}{names[1:]} did not come up within {timeout:g} s (its "
                    "port did not answer: not started, down, or unreachable from here). Start "
                    "every task of the cluster (each with its own task index), check that "
                    "this machine reaches it, or wait longer with a larger cluster_timeout.")
            if time.monotonic() >= next_report:
                report(f"Waiting for {names} since {since} ({waited:.0f} s; giving up after "
                       f"{timeout:g} s).")
                next_report = time.monotonic() + report_every
            time.sleep(0.25)


@contextlib.contextmanager
def _held_port(own: str, task_type: str) -> Iterator[socket.socket]:
    """Listens at this task's port (as TensorFlow's server will), non-blocking, until the
    block ends; a port taken by another program is found at once."""
    port = split_address(own)[1]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortTakenError(f"Port {port} of this {task_type} ({own}) is in use by "
                                     "another program. Give the cluster free ports.") from None
            raise ClusterError(f"Cannot listen at {own} ({e.strerror}).") from None
        listener.listen(64)
        listener.setblocking(False)
        yield listener
    finally:
        listener.close()


def _greet_probes(listener: socket.socket) -> None:
    """Answers every peer's probe waiting at ``listener`` with tfpar's greeting."""
    try:
        while True:
            with listener.accept()[0] as peer:
                peer.send(_GREETING)
    except (BlockingIOError, InterruptedError):
        pass


LEAVE_LAST_SECONDS = 5.0
"""How long the chief, at exit, waits for the other tasks to leave first."""


def leave_last(cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver,
               timeout: float = LEAVE_LAST_SECONDS) -> None:
    """Waits until no other task of the cluster answers at its port (their processes have
    ended, or hang), for at most ``timeout`` seconds.

    The chief leads TensorFlow's coordination service: when its process ends before another
    worker's, that worker's next heartbeat fails and TensorFlow prints ``StartAbort UNAVAILABLE
    ... CoordinationService/Heartbeat`` lines after a job that ended well. The chief calls this
    as it exits, so that it leaves last. Stopped meanwhile (Ctrl-C, or a launcher stopping the
    job after a peer failed), it leaves at once, quietly.
    """
    spec = cluster_resolver.cluster_spec()
    me = (cluster_resolver.task_type, cluster_resolver.task_id)
    others = [spec.task_address(job, index) for job in spec.jobs
              for index in spec.task_indices(job) if (job, index) != me]
    deadline = time.monotonic() + timeout
    try:
        while others and time.monotonic() < deadline:
            others = [address for address in others if _answers(address)]
            if others:
                time.sleep(0.1)
    except KeyboardInterrupt:
        pass


def connect(make: Callable[[], tf.distribute.Strategy],
            cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None,
            timeout: float = DEFAULT_TIMEOUT_SECONDS) -> tf.distribute.Strategy:
    """Builds a multi-worker strategy with ``make`` once the cluster's peers are up.

    Around TensorFlow's constructor it:

    - waits for the peers first with :func:`wait_for_peers` (messages, timeout, signals);
    - turns TensorFlow's end of a set-up that a peer left (every task must register within
      ``timeout``; see ``tfpar.compat.coordination``) into :class:`PeerUnreachableError`;
    - warns once when the workers are reachable from the network: TensorFlow's gRPC server
      listens on every interface, unauthenticated (the launcher's private network avoids it);
    - gives SIGTERM back to the program: TensorFlow's coordination service installs a C++
      SIGTERM handler (its preemption notifier) that only records the notice, so the process
      would otherwise ignore SIGTERM and train on;
    - has the chief leave last when the program exits (:func:`leave_last`).

    Args:
        make: Builds the strategy (TensorFlow connects to the cluster in it).
        cluster_resolver: The cluster (``None``: a single local worker).
        timeout: Seconds to wait for the peers.

    Returns:
        The strategy.

    Raises:
        PortTakenError: If this worker's port is in use by another program.
        PeerUnreachableError: If the peers do not come up within ``timeout``, or one goes away
            before every task registered.
    """
    if cluster_resolver is not None and cluster_resolver.cluster_spec().jobs:
        if os.environ.get(worker_contract.PRIVATE_NETWORK_ENV) != "1":
            address = cluster_resolver.cluster_spec().task_address(cluster_resolver.task_type,
                                                                   cluster_resolver.task_id)
            logging.warning(
                "This worker's TensorFlow server listens at port %s on every network interface, "
                "with no authentication: firewall that port, or keep the cluster's machines on a "
                "private network as a Ray cluster's own ports need (local jobs run by tfpar's "
                "launcher are kept on a private loopback instead).", split_address(address)[1])
        wait_for_peers(cluster_resolver, timeout)
    import tensorflow as tf

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        strategy = make()
    except tf.errors.DeadlineExceededError:
        raise PeerUnreachableError(
            f"A peer went away while TensorFlow connected the cluster: not every task "
            f"registered within {timeout:g} s. Restart every task of the job (tfpar's launcher "
            "does with max_restarts), or wait longer with a larger cluster_timeout.") from None
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" in str(e):
            raise PortTakenError("This worker's TensorFlow server could not bind its port: it "
                                 "was taken by another program just before. Give the cluster "
                                 "free ports.") from None
        raise
    if previous is not None:
        signal_router.install({signal.SIGTERM: previous})
    if cluster_resolver is not None and is_multi_worker(strategy) and is_chief(strategy):
        atexit.register(leave_last, cluster_resolver)
    return strategy


def counts_of_every_worker(resolver: tf.distribute.cluster_resolver.ClusterResolver, name: str,
                           count: int, what: str, timeout: float) -> dict[tuple[str, int], int]:
    """Each worker's count of ``name`` (this one's ``count``), through the job's coordination
    service, for a check that every worker agrees (where
    :mod:`tfpar.compat.coordination_values` applies; elsewhere only this worker's).

    Every worker must call it with the same ``name`` (once per name), after the job's strategy
    connected them. A peer that has not written its count within ``timeout``, a minute at most
    (one deadline for all), is gone (training will say so) and left out; meanwhile a line every
    few seconds names the worker waited for and ``what`` it is to say.

    Returns:
        ``{(job, index): count}`` of the workers that said theirs.
    """
    from tfpar.compat import coordination_values  # noqa: PLC0415 (imports TensorFlow)

    own = (resolver.task_type, int(resolver.task_id))
    if coordination_values.skip_reason() is not None:
        return {own: count}
    cluster = resolver.cluster_spec().as_dict()
    tasks = [(job, index) for job in ("chief", "worker")
             for index in range(len(cluster.get(job, ())))]
    coordination_values.insert(f"tfpar/{name}/{own[0]}/{own[1]}", str(count))
    started = time.monotonic()
    deadline = started + min(timeout, COUNT_WAIT_SECONDS)
    counts = {}
    for job, index in tasks:
        value = None
        while value is None and time.monotonic() < deadline:
            value = coordination_values.wait_for(
                f"tfpar/{name}/{job}/{index}",
                min(REPORT_EVERY_SECONDS, deadline - time.monotonic()))
            if value is None:
                logging.warning("Waiting for %s %d to say %s (%.0f s; giving up after %.0f s).",
                                job, index, what, time.monotonic() - started,
                                deadline - started)
        if value is not None:
            counts[(job, index)] = int(value)
    return counts

