"""A chaos soak: a 2-worker job under ``scripts/launch.py --max_restarts`` with faults injected at
random (seeded) times, ending with the weights of the same job run without faults.

Faults, one at a time, each after the job saved two epochs past the last fault's (so each finds
the job training after the previous one) and a random delay:

- ``kill``: ``kill -9`` of a random worker (the launcher restarts the job);
- ``stop``: ``SIGSTOP`` of a random worker for 0.5-6 s, then ``SIGCONT`` (past the job's
  3 s heartbeat timeout the job stops with exit 69 and is restarted; shorter, it goes on);
- ``term``: a preemption notice (``SIGTERM``) to a random worker: every worker stops after the
  same step, saves there and exits 85, and the launcher restarts the job without counting a
  failure;
- ``notice_all``: a notice (``SIGUSR1``) to every worker at once, as a whole job's preemption;
- ``notice_saving``: a notice (``SIGTERM``) to a random worker while a save is being written
  (its ``ckpt-N_temp`` folder exists);
- ``launcher``: ``kill -9`` of the launcher itself, which takes its workers with it, then the
  same command run again by hand;
- ``disk``: the model folder's file system filled to the last byte until a worker fails to
  save (exit 74, restarted), then emptied.

The model folder is a small ``tmpfs`` in a user and mount namespace of the soak's own (held by
a ``sleep`` process; the launcher joins it with ``nsenter``), so a full disk touches nothing
else. Every run checks: the final weights equal the uninterrupted run's, every checkpoint left
loads, and ``--output`` holds each epoch once.

Run the long version with ``python tests/end_to_end/chaos_soak.py --seed=1 --faults=24
--epochs=56``; ``chaos_soak_test.py`` runs a short one in the suite and the long one as a slow
test. Linux only (namespaces, ``nsenter``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("kill", "stop", "term", "notice_all", "notice_saving", "launcher", "disk")
HEARTBEAT_SECONDS = 3
STATE = "multi_worker_1_devices"
_SAVED = re.compile(r"Saved training state after epoch (\d+) ")


@dataclasses.dataclass
class SoakReport:
    """What one soak did and found.

    Attributes:
        faults: Injected faults by kind.
        restarts: Restarts the launchers made.
        launches: Launcher processes started (1 + the reruns after ``launcher`` faults).
        seconds: Wall time of the soak's job, faults and restarts included.
        uninterrupted_seconds: Wall time of the same job without faults.
        mismatched: Variables whose final value differs from the uninterrupted run's.
        unloadable: Checkpoints left that fail to load.
        epochs_in_output: The epochs ``--output`` lists, in order.
    """

    faults: dict[str, int]
    restarts: int
    launches: int
    seconds: float
    uninterrupted_seconds: float
    mismatched: list[str]
    unloadable: list[str]
    epochs_in_output: int

    @property
    def seconds_lost_per_fault(self) -> float:
        total = sum(self.faults.values())
        return (self.seconds - self.uninterrupted_seconds) / total if total else 0.0


class _MountNamespace:
    """A user and mount namespace holding a ``tmpfs`` of ``megabytes`` at ``path``."""

    def __init__(self, path: str, megabytes: int):
        os.makedirs(path, exist_ok=True)
        self.holder = subprocess.Popen(
            ["unshare", "-rm", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={megabytes}m tmpfs {path} && echo ready && exec sleep 1d"],
            stdout=subprocess.PIPE, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            raise RuntimeError("Could not mount a tmpfs in a user and mount namespace.")
        self.path = path
        self.inside = f"/proc/{self.holder.pid}/root{path}"  # The tmpfs, seen from outside.

    def command(self, command: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-U", "-m", "--preserve-credentials",
                "--wd=" + os.getcwd(), *command]

    def fill(self) -> None:
        """Writes a file until the file system has no byte left."""
        descriptor = os.open(os.path.join(self.inside, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        os.write(descriptor, b"\0" * size)
                except OSError:
                    pass
        finally:
            os.close(descriptor)

    def empty(self) -> None:
        os.remove(os.path.join(self.inside, "filler"))

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class _Launch:
    """One launcher process, its output read by a thread."""

    def __init__(self, command: list[str], log):
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.write(line)
            self.lines.put(line)
        self.lines.put("")

    def workers(self) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True,
                               text=True).stdout.split()
        return sorted(int(p) for p in found)


def job_command(model_dir: str, output: str, epochs: int, max_restarts: int) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2",
            f"--max_restarts={max_restarts}", "--", sys.executable,
            os.path.join(ROOT, "scripts", "train.py"), "--strategy=multi_worker",
            "--dataset=digits", "--batch_size=256", f"--epochs={epochs}", "--seed=1",
            "--deterministic", f"--heartbeat_timeout={HEARTBEAT_SECONDS}",
            f"--model_dir={model_dir}", f"--output={output}", "--verbose=2"]


def _final_weights(model_dir: str) -> dict:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(model_dir, STATE)))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "model_variables" in name}


def _unloadable(model_dir: str) -> list[str]:
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(os.path.join(model_dir, STATE))
    bad = []
    for path in state.all_model_checkpoint_paths if state else []:
        try:
            tf.train.load_checkpoint(path)
        except Exception:  # noqa: BLE001 (any failure to load is the finding)
            bad.append(path)
    return bad


def _epochs_in_output(output: str) -> int:
    with open(output, encoding="utf-8") as f:
        results = json.load(f)["results"]
    return len(results[0]["history"]["loss"])


def uninterrupted(work: str, epochs: int) -> tuple[dict, float]:
    """Runs the job without faults; returns its final weights and wall time."""
    model_dir, output = os.path.join(work, "model"), os.path.join(work, "output.json")
    os.makedirs(work, exist_ok=True)
    start = time.monotonic()
    result = subprocess.run(job_command(model_dir, output, epochs, 0), capture_output=True,
                            text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode:
        raise RuntimeError(f"the uninterrupted job failed:\n{result.stdout[-3000:]}")
    return _final_weights(model_dir), time.monotonic() - start


def soak(seed: int, faults: int, epochs: int, work: str, reference: tuple[dict, float],
         log=sys.stderr, kinds: tuple[str, ...] = KINDS) -> SoakReport:
    """Runs the job with ``faults`` faults; see the module docstring.

    Args:
        seed: Seeds the choice of faults, workers, delays and stop lengths.
        faults: How many faults to inject (the first ``len(kinds)`` are one of each kind).
        epochs: The job's epochs (leave at least two per fault, and a few more).
        work: A folder for the soak's files.
        reference: :func:`uninterrupted`'s result for the same ``epochs``.
        log: Where the launchers' output goes.
        kinds: The kinds of fault to draw from.

    Returns:
        The report.
    """
    rng = random.Random(seed)
    plan = list(kinds) + [rng.choice(kinds) for _ in range(faults - len(kinds))]
    plan = plan[:faults]
    rng.shuffle(plan)
    namespace = _MountNamespace(os.path.join(work, "model"), megabytes=64)
    output = os.path.join(work, "output.json")
    command = namespace.command(job_command(namespace.path, output, epochs, 10 * faults))
    counts: collections.Counter[str] = collections.Counter()
    restarts, launches, start = 0, 1, time.monotonic()
    launch = _Launch(command, log)
    try:
        saved = -1
        for kind in plan:
            saved, restarts = _wait_for_a_save(launch, saved, restarts)
            if saved >= epochs:
                break
            time.sleep(rng.uniform(0.0, 1.5))
            log.write(f"chaos: {kind} (after epoch {saved})\n")
            launch, rerun = _inject(kind, launch, rng, namespace, command, log)
            launches += rerun
            counts[kind] += 1
        status, restarts = _wait_for_the_end(launch, restarts)
        seconds = time.monotonic() - start
        if status != 0:
            raise RuntimeError(f"the job ended with status {status} (seed {seed}).")
        weights, reference_seconds = reference
        final = _final_weights(namespace.inside)
        mismatched = sorted(name for name, value in weights.items()
                            if name not in final or not (final[name] == value).all())
        return SoakReport(dict(counts), restarts, launches, seconds, reference_seconds,
                          mismatched, _unloadable(namespace.inside), _epochs_in_output(output))
    finally:
        launch.process.kill()
        namespace.close()


def _count_restarts(line: str, restarts: int) -> int:
    return restarts + (1 if line.startswith("launcher: restart ") else 0)


def _wait_for_a_save(launch: _Launch, saved: int, restarts: int) -> tuple[int, int]:
    """Reads the job's output until it saves an epoch after ``saved`` (or ends)."""
    while True:
        line = launch.lines.get(timeout=600)
        if not line:
            return 1 << 30, restarts  # Ended.
        restarts = _count_restarts(line, restarts)
        match = _SAVED.search(line)
        if match and int(match.group(1)) > saved + 1:
            return int(match.group(1)), restarts


def _wait_for_the_end(launch: _Launch, restarts: int) -> tuple[int, int]:
    while line := launch.lines.get(timeout=900):
        restarts = _count_restarts(line, restarts)
    return launch.process.wait(timeout=60), restarts


def _inject(kind: str, launch: _Launch, rng: random.Random, namespace: _MountNamespace,
            command: list[str], log) -> tuple[_Launch, int]:
    """Injects one fault; returns the launcher running afterwards and 1 if it was rerun."""
    workers = launch.workers()  # nsenter execs the launcher: its children are the workers.
    if kind == "launcher":
        launch.process.kill()
        launch.process.wait()
        while launch.lines.get(timeout=60):
            pass
        return _Launch(command, log), 1
    if kind == "disk":
        namespace.fill()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # Until a save failed (the worker's exit 74).
            try:
                line = launch.lines.get(timeout=1)
            except queue.Empty:
                continue
            if "exited with 74" in line or not line:
                if not line:
                    launch.lines.put(line)
                break
        namespace.empty()
        return launch, 0
    if kind == "notice_saving":
        _wait_for_a_save_in_progress(os.path.join(namespace.inside, STATE))
        workers = launch.workers()
    if not workers:
        return launch, 0  # Between a failure and the restart: nothing to hit.
    target = rng.choice(workers)
    if kind == "notice_all":
        for worker in workers:
            _signal(worker, signal.SIGUSR1)
    if kind == "kill":
        _signal(target, signal.SIGKILL)
    elif kind in ("term", "notice_saving"):
        _signal(target, signal.SIGTERM)
    elif kind == "stop":
        _signal(target, signal.SIGSTOP)
        time.sleep(rng.uniform(0.5, 6.0))
        _signal(target, signal.SIGCONT)
    return launch, 0


def _wait_for_a_save_in_progress(state: str, timeout: float = 60.0) -> None:
    """Returns as soon as a checkpoint is being written in ``state`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(name.endswith("_temp") for name in os.listdir(state)):
                return
        except OSError:
            pass
        time.sleep(0.002)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=56)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tfpar_chaos_")
    try:
        reference = uninterrupted(os.path.join(work, "uninterrupted"), args.epochs)
        log_path = os.path.join(work, "soak.log")
        with open(log_path, "w", encoding="utf-8") as log:
            report = soak(args.seed, args.faults, args.epochs, os.path.join(work, "soak"),
                          reference, log)
        print(json.dumps({**dataclasses.asdict(report),
                          "seconds_lost_per_fault": report.seconds_lost_per_fault}, indent=1))
        ok = not report.mismatched and not report.unloadable and \
            report.epochs_in_output == args.epochs
        print("exact weights, every checkpoint loads, each epoch once" if ok else "FAILED")
        sys.exit(0 if ok else 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
