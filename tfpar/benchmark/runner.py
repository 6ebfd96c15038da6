"""Throughput benchmark: steady-state images/s of configurations side by side, measured honestly.

Each configuration (:mod:`.configuration`)
runs in a process of its own (:mod:`.worker`; a multi-worker configuration in
one process per worker), because TensorFlow fixes its threads and devices per process: so a
1-device run can have one core while a 2-device run has one per device, and plain Keras has
TensorFlow's defaults. All processes are built and warmed up first and stay alive; then the
rounds interleave them (A, B, C, then B, C, A, ...), one short slice of ``steps`` steps each,
while the others wait idle.

Ratios between configurations are *paired*: the median over rounds of the per-round ratio.
The shared machines here change speed for seconds at a time (throttling that halves a
round's speed, then lifts); configurations measured seconds apart in the same round see
nearly the same machine, so the per-round ratio cancels most of it, where comparing two
runs' averages would not. Images/s are reported as the median round, with the best round and
the spread beside it, so the noise stays visible.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence

from tfpar import worker_contract
from tfpar.benchmark.measurements import Ceiling
from tfpar.benchmark.measurements import Configuration
from tfpar.benchmark.measurements import Measurement
from tfpar.cluster import launcher
from tfpar.cluster import private_network
from tfpar.cluster import worker_environment
from tfpar.errors import ConfigError


class _Processes:
    """The running process(es) of one configuration, answering ``RUN k`` requests."""

    def __init__(self, configuration: Configuration, stack: contextlib.ExitStack,
                 profile_steps: int, profile_dir: str):
        self.configuration = configuration
        started_at = time.time()
        count = configuration.num_processes
        namespace = None
        if count > 1 and not isinstance(configuration.strategy, Ceiling):
            try:  # Workers of a job are kept off the network, as the launcher keeps them.
                namespace = stack.enter_context(private_network.Namespace())
            except ConfigError:
                pass  # Not Linux, or no user namespaces: the workers warn about their ports.
            environments = [worker_environment.worker_environment(
                {"TF_CONFIG": c, worker_contract.PRIVATE_NETWORK_ENV: "1" if namespace else "0"})
                for c in launcher.tf_configs(count)]
        else:
            environments = [worker_environment.worker_environment()] * count
        self.processes: list[subprocess.Popen[str]] = []
        self.logs: list = []
        for index, env in enumerate(environments):
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            command = [sys.executable, "-m", "tfpar.benchmark.worker", configuration.to_json()]
            if profile_steps:
                c = configuration
                name = f"{c.model}_{c.strategy.name}_{c.num_devices}" + (
                    f"_process{index}" if count > 1 else "")
                command += [str(profile_steps), os.path.join(profile_dir, name)]
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                preexec_fn=namespace.enter if namespace else None)
            stack.callback(_end, process)
            self.processes.append(process)
            self.logs.append(log)
        # Every process must be ready; they all describe the same configuration.
        self.info = [json.loads(self._reply(i, "READY")) for i in range(count)][0]
        # Until the first step of the job (its chief's; the workers of a job step together).
        self.startup_seconds = self.info["first_step_at"] - started_at

    def _reply(self, index: int, verb: str) -> str:
        process = self.processes[index]
        assert process.stdout is not None  # A pipe.
        for line in process.stdout:
            if line.startswith(verb + " "):
                return line[len(verb) + 1:].strip()
            if line.startswith("ERROR "):
                error = json.loads(line[len("ERROR "):])
                raise ConfigError(error["message"], argument=error["argument"])
        process.wait()
        # A worker of a job often fails because a peer failed first: show every log.
        logs = []
        for i, log in enumerate(self.logs):
            log.seek(0)
            logs.append(f"--- log of worker {i} ---\n{log.read()[-3000:]}"
                        if len(self.logs) > 1 else log.read()[-3000:])
        raise RuntimeError(f"The benchmark process of {self.configuration} (worker {index}) "
                           f"ended with status {process.returncode}:\n" + "\n".join(logs))

    def measure(self, steps: int) -> tuple[float, float, float]:
        """Trains ``steps`` steps; returns images/s, the seconds of one all-reduce, and the
        machine's steal fraction meanwhile."""
        before = _cpu_times()
        for process in self.processes:
            assert process.stdin is not None  # A pipe.
            process.stdin.write(f"RUN {steps}\n")
            process.stdin.flush()
        replies = [self._reply(i, "DONE").split() for i in range(len(self.processes))]
        batch = self.configuration.step_batch_size
        if isinstance(self.configuration.strategy, Ceiling):
            batch //= len(self.processes)
        rates = [int(measured_steps) * batch / float(seconds)
                 for seconds, measured_steps, _ in replies]
        # Workers of one job wait on each other: worker 0's rate is the job's. Independent
        # processes each train their share of the batch: their rates add up.
        rate = sum(rates) if isinstance(self.configuration.strategy, Ceiling) else rates[0]
        after = _cpu_times()
        steal = (after[0] - before[0]) / max(after[1] - before[1], 1)
        return rate, float(replies[0][2]), steal


def _cpu_times() -> tuple[int, int]:
    """(steal, total) CPU time of the machine so far, in clock ticks; zeros without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None and process.stdin is not None:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(sweep: Sequence[Configuration], steps: int = 10, rounds: int = 5,
        progress: Callable[[str], None] | None = print, profile_steps: int = 0,
        profile_dir: str = "tfpar_profile") -> list[Measurement]:
    """Starts every configuration, then measures them in interleaved rounds.

    Args:
        sweep: The configurations (see :func:`configurations`).
        steps: Training steps per measured slice (at least two compiled calls).
        rounds: Measured rounds; each configuration runs one slice per round.
        progress: Called with a line of progress text; ``None`` for silence.
        profile_steps: After warm-up, every process traces this many steps for TensorBoard's
            profiler (not measured) into ``profile_dir/{model}_{strategy}_{devices}``
            (``_process{i}`` added for each process of a multi-process configuration; of a
            multi-worker job, only the chief, process 0, traces).
        profile_dir: Where the traces go.

    Returns:
        One :class:`Measurement` per configuration, in ``sweep``'s order.

    Raises:
        ConfigError: If a configuration cannot run (e.g. XLA on several CPU replicas).
        RuntimeError: If a configuration's process fails (its error output is in the message).
    """
    with contextlib.ExitStack() as stack:
        running, measurements = [], []
        for configuration in sweep:
            if progress:
                progress(f"starting {configuration.description}")
            processes = _Processes(configuration, stack, profile_steps, profile_dir)
            running.append(processes)
            measurements.append(Measurement(configuration, processes.info["devices"],
                                            processes.info["training_flops_per_image"],
                                            startup_seconds=processes.startup_seconds,
                                            gradient_bytes=processes.info["gradient_bytes"]))
        for round_index in range(rounds):
            order = list(range(len(sweep)))
            order = order[round_index % len(order):] + order[:round_index % len(order)]
            for i in order:
                images_per_second, all_reduce_seconds, steal = running[i].measure(steps)
                measurements[i].images_per_second.append(images_per_second)
                measurements[i].all_reduce_seconds.append(all_reduce_seconds)
                measurements[i].steal_fraction.append(steal)
                if progress:
                    progress(f"round {round_index + 1}/{rounds}: {sweep[i].description} "
                             f"{measurements[i].images_per_second[-1]:.1f} images/s")
    return measurements
