"""A local launcher: N worker processes of one command on loopback, with TF_CONFIG each.

It picks free ports, gives each worker its ``TF_CONFIG``, prefixes every output line with the
worker's rank, and supervises: if a worker fails or is killed, the others are stopped and the
launcher reports which worker failed; Ctrl-C or SIGTERM stops every worker. Workers run in
their own process groups, so nothing they start outlives the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

from tfpar.errors import ConfigError

STOP_GRACE_SECONDS = 10.0
# Set to "1" in the workers' environment to have every worker print its progress and report
# (tfpar's programs otherwise print them on the chief only).
ALL_OUTPUT_ENV = "TFPAR_ALL_WORKERS_OUTPUT"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ConfigError(f"Cannot open a port on host {host!r} ({reason}): the workers run on "
                          "this machine, so give one of its addresses, e.g. 127.0.0.1.") from None
    finally:
        for s in sockets:
            s.close()


def tf_configs(num_workers: int, host: str = "127.0.0.1") -> list[str]:
    """Returns each worker's ``TF_CONFIG`` for a cluster of ``num_workers`` on ``host``."""
    workers = [f"{host}:{port}" for port in free_ports(num_workers, host)]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            for i in range(num_workers)]


def _forward(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the workers as Ctrl-C does.


def launch(command: Sequence[str], num_workers: int, host: str = "127.0.0.1",
           out: Optional[TextIO] = None, all_output: bool = False) -> int:
    """Runs ``command`` as ``num_workers`` workers and supervises them.

    Args:
        command: The program and its arguments, e.g. ``["python", "scripts/train.py", ...]``.
        num_workers: Number of worker processes.
        host: Address the workers' servers bind (loopback unless told otherwise).
        out: Where prefixed output goes (standard output by default).
        all_output: Every worker prints progress and reports, not only the chief.

    Returns:
        0 if every worker succeeded; else the failing worker's exit status (or 128 + signal),
        130 after Ctrl-C.

    Raises:
        ConfigError: If the command is empty or cannot be run, ``num_workers`` < 1, or
            ``host`` is not an address of this machine.
    """
    if not command:
        raise ConfigError("Give the command to run after '--', e.g. -- python scripts/train.py "
                          "--strategy=multi_worker.")
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1. Received: {num_workers}.")
    out = out or sys.stdout
    lock = threading.Lock()
    processes, threads = [], []
    for rank, config in enumerate(tf_configs(num_workers, host)):
        env = {**os.environ, "TF_CONFIG": config, "PYTHONUNBUFFERED": "1",
               ALL_OUTPUT_ENV: "1" if all_output else "0"}
        try:
            p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        except OSError as e:
            _stop(processes)
            raise ConfigError(f"Cannot run {command[0]!r}: {e.strerror}. Give a program on "
                              "PATH or its path, e.g. -- python scripts/train.py.") from None
        processes.append(p)
        t = threading.Thread(target=_forward, args=(p.stdout, f"[worker {rank}] ", out, lock),
                             daemon=True)
        t.start()
        threads.append(t)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            for rank, p in enumerate(processes):
                code = p.poll()
                if code not in (None, 0):
                    _stop(processes)
                    status = 128 - code if code < 0 else code
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
                    with lock:
                        out.write(f"launcher: worker {rank} {how}; stopped the other workers.\n")
                    return status
            if all(p.poll() == 0 for p in processes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(processes)
        with lock:
            out.write("launcher: interrupted; stopped every worker.\n")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for t in threads:
            t.join(timeout=5)
