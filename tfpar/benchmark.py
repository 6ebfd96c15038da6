"""Throughput benchmark: steady-state images/s of configurations side by side, measured honestly.

A configuration is a strategy x device count x model (x dtype, XLA, steps per call). Each one
runs in a process of its own (:mod:`tfpar.benchmark_worker`; a multi-worker configuration in
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
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import itertools
from typing import Any, Callable, Mapping, Optional, Sequence

from tfpar import atomic_io
from tfpar import launcher
from tfpar import private_network
from tfpar.errors import ConfigError

BASELINE = "keras"  # Plain single-device Keras: no strategy, TensorFlow's default threads.
# N processes each training plain Keras alone on one device of ``threads_per_device`` threads
# and 1/N of the global batch (a replica's share), side by side: data parallelism with no
# communication at all, the most N devices can give.
CEILING = "independent"


@dataclasses.dataclass(frozen=True)
class Configuration:
    """What one measured configuration trains, and on what.

    Attributes:
        strategy: Registry name, ``"keras"`` for plain Keras with no strategy, or
            ``"independent"`` for ``num_devices`` plain Keras processes side by side.
        options: Options of the registry entry, as ``(name, value)`` pairs.
        num_devices: Replicas: logical devices in one process, or worker processes of one
            device each for multi-process strategies (``multi_worker``).
        model: Model name.
        batch_size: Global batch size (over all replicas) of one forward and backward pass;
            with ``accumulation_steps`` k among the options, each step (one update) trains k
            such micro-batches (see :attr:`step_batch_size`).
        threads_per_device: Intra-op threads of each device; ignored by ``"keras"``, which
            keeps TensorFlow's defaults (every core).
        dtype: Keras dtype policy.
        jit_compile: Compile the step with XLA.
        steps_per_execution: Steps per compiled call.
        warmup_steps: Unmeasured steps after building (tracing, allocator warm-up).
        image_shape: Synthetic image shape.
        communication: ``False`` runs tfpar's all-reduce step without its all-reduce (a
            measurement of the step's computation alone; see
            ``tfpar.allreduce.without_communication``).
    """

    strategy: str
    num_devices: int
    model: str
    batch_size: int
    threads_per_device: int = 1
    options: tuple[tuple[str, Any], ...] = ()
    dtype: str = "float32"
    jit_compile: bool = False
    steps_per_execution: int = 1
    warmup_steps: int = 3
    image_shape: tuple[int, ...] = (28, 28, 1)
    communication: bool = True

    @property
    def num_processes(self) -> int:
        """Processes this configuration runs as: one per device for ``"independent"`` and for
        multi-process strategies (one worker per device), else one."""
        if self.strategy == CEILING:
            return self.num_devices
        if self.strategy == BASELINE:
            return 1
        from tfpar import strategies  # Imports TensorFlow; the rest of this module does not.

        return self.num_devices if strategies.entry(self.strategy).multi_process else 1

    @property
    def step_batch_size(self) -> int:
        """Images of one step (one update): ``batch_size`` times the accumulation steps."""
        return self.batch_size * dict(self.options).get("accumulation_steps", 1)

    @property
    def label(self) -> str:
        """The strategy with its options, e.g. ``allreduce(algorithm=ring)``."""
        parts = [f"{k}={v}" for k, v in self.options] + (
            [] if self.communication else ["no all-reduce"])
        return f"{self.strategy}({','.join(parts)})" if parts else self.strategy

    def to_json(self) -> str:
        """The configuration as JSON (the worker's command-line argument)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Configuration":
        """Inverse of :meth:`to_json`."""
        fields = json.loads(text)
        fields["image_shape"] = tuple(fields["image_shape"])
        fields["options"] = tuple((k, tuple(v) if isinstance(v, list) else v)
                                  for k, v in fields["options"])
        return cls(**fields)


@dataclasses.dataclass
class Measurement:
    """The images/s of one configuration over the measurement rounds.

    Attributes:
        configuration: What was measured.
        devices: The replicas' devices (``worker:1/CPU:0`` for other workers' devices).
        training_flops_per_image: FLOPs of one training step per image (see tfpar.flops).
        images_per_second: One figure per round.
        all_reduce_seconds: Per round, the time of one all-reduce of the model's gradients
            through the strategy alone: the communication in every step.
        steal_fraction: Per round, the share of the machine's CPU time that the hypervisor
            gave to other guests ("steal" in ``/proc/stat``) while the slice ran: where it is
            high, the round measured a throttled machine, not the configuration.
    """

    configuration: Configuration
    devices: list[str]
    training_flops_per_image: int = 0
    images_per_second: list[float] = dataclasses.field(default_factory=list)
    all_reduce_seconds: list[float] = dataclasses.field(default_factory=list)
    steal_fraction: list[float] = dataclasses.field(default_factory=list)

    @property
    def strategy(self) -> str:
        """The strategy's registry name with its options (see ``Configuration.label``)."""
        return self.configuration.label

    @property
    def model(self) -> str:
        """The model's name."""
        return self.configuration.model

    @property
    def best(self) -> float:
        """Best (highest) images/s over the rounds."""
        return max(self.images_per_second)

    @property
    def worst(self) -> float:
        """Worst (lowest) images/s over the rounds."""
        return min(self.images_per_second)

    @property
    def median(self) -> float:
        """Median images/s over the rounds: the headline figure."""
        return statistics.median(self.images_per_second)

    @property
    def all_reduce_share(self) -> float:
        """Median over rounds of the all-reduce's share of a step's time."""
        return statistics.median(
            seconds * ips / self.configuration.step_batch_size
            for seconds, ips in zip(self.all_reduce_seconds, self.images_per_second))

    @property
    def gflops_per_second(self) -> float:
        """Achieved training GFLOP/s at the median images/s."""
        return self.median * self.training_flops_per_image / 1e9

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds, as a fraction."""
        return (max(self.images_per_second) - min(self.images_per_second)) / self.median


def paired_ratio(a: Measurement, b: Measurement) -> float:
    """Median over rounds of ``a``'s images/s divided by ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(a.images_per_second, b.images_per_second))


def configurations(strategy_names: Sequence[str], device_counts: Sequence[int],
                   model_names: Sequence[str], batch_size: int,
                   threads_per_device: Optional[int] = None, baseline: bool = False,
                   ceiling: bool = False,
                   strategy_options: Optional[Mapping[str, Sequence[Any]]] = None,
                   communication_share: bool = False, **options) -> list[Configuration]:
    """The sweep: every model x strategy (x its options) x device count, plain Keras first.

    Args:
        strategy_names: Registry names.
        device_counts: Device counts (worker counts for multi-process strategies).
        model_names: Model names.
        batch_size: Global batch size, the same for every configuration.
        threads_per_device: Intra-op threads of each device. ``None``: the cores divided by
            the largest device count, so every device of every configuration has the same share
            (with 2 cores and counts 1, 2: one core each, and "2 / 1" is scaling from one core
            to two).
        baseline: Also plain Keras with no strategy on TensorFlow's default threads (all cores):
            ``vs keras`` is then a comparison on the same cores.
        ceiling: Also ``"independent"`` for every device count: that many processes
            training alone, side by side, one device and a replica's share of the batch each;
            their total images/s is what the machine gives that many devices with no
            communication, the ceiling of any strategy.
        strategy_options: Option name to the values to sweep, e.g. ``{"algorithm": ["ring",
            "naive"]}``: every strategy whose registry entry takes an option is measured once
            per combination of the values given for its options.
        communication_share: Also every configuration of an entry that runs tfpar's
            all-reduce step (its options include ``accumulation_steps``) without the
            all-reduce, so the table shows the communication's share of a step in context.
        **options: More :class:`Configuration` fields (dtype, jit_compile, ...).

    Returns:
        The configurations, in the order they are started and measured.
    """
    if threads_per_device is None:
        threads_per_device = max(1, (os.cpu_count() or 1) // max(device_counts))
    sweep = [Configuration(BASELINE, 1, m, batch_size, **options)
             for m in model_names] if baseline else []
    variants = [(s, o) for s in strategy_names for o in _option_sets(s, strategy_options or {})]
    variants = [(s, o, True) for s, o in variants] + (
        [(s, o, False) for s, o in variants if _runs_the_allreduce_step(s)]
        if communication_share else [])
    variants += [(CEILING, (), True)] if ceiling else []
    return sweep + [Configuration(s, n, m, batch_size, threads_per_device, o,
                                  communication=c, **options)
                    for m in model_names for s, o, c in variants for n in device_counts]


def _runs_the_allreduce_step(strategy: str) -> bool:
    from tfpar import strategies  # Imports TensorFlow; the rest of this module does not.

    return "accumulation_steps" in strategies.entry(strategy).options()


def _option_sets(strategy: str, values: Mapping[str, Sequence[Any]]
                 ) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the swept values of the options ``strategy``'s entry takes."""
    from tfpar import strategies  # Imports TensorFlow; the rest of this module does not.

    taken = [name for name in strategies.entry(strategy).options() if name in values]
    return [tuple(zip(taken, combination))
            for combination in itertools.product(*(values[name] for name in taken))]


class _Processes:
    """The running process(es) of one configuration, answering ``RUN k`` requests."""

    def __init__(self, configuration: Configuration, stack: contextlib.ExitStack,
                 profile_steps: int, profile_dir: str):
        self.configuration = configuration
        count = configuration.num_processes
        namespace = None
        if count > 1 and configuration.strategy != CEILING:
            try:  # Workers of a job are kept off the network, as the launcher keeps them.
                namespace = stack.enter_context(private_network.Namespace())
            except ConfigError:
                pass  # Not Linux, or no user namespaces: the workers warn about their ports.
            environments = [dict(os.environ, TF_CONFIG=c,
                                 **{launcher.PRIVATE_NETWORK_ENV: "1" if namespace else "0"})
                            for c in launcher.tf_configs(count)]
        else:
            environments = [dict(os.environ)] * count
        self.processes, self.logs = [], []
        for index, env in enumerate(environments):
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            command = [sys.executable, "-m", "tfpar.benchmark_worker", configuration.to_json()]
            if profile_steps:
                c = configuration
                name = f"{c.model}_{c.strategy}_{c.num_devices}" + (
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

    def _reply(self, index: int, verb: str) -> str:
        process = self.processes[index]
        for line in process.stdout:
            if line.startswith(verb + " "):
                return line[len(verb) + 1:].strip()
            if line.startswith("ERROR "):
                raise ConfigError(line[len("ERROR "):].strip())
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
            process.stdin.write(f"RUN {steps}\n")
            process.stdin.flush()
        replies = [self._reply(i, "DONE").split() for i in range(len(self.processes))]
        batch = self.configuration.step_batch_size
        if self.configuration.strategy == CEILING:
            batch //= len(self.processes)
        rates = [int(measured_steps) * batch / float(seconds)
                 for seconds, measured_steps, _ in replies]
        # Workers of one job wait on each other: worker 0's rate is the job's. Independent
        # processes each train their share of the batch: their rates add up.
        rate = sum(rates) if self.configuration.strategy == CEILING else rates[0]
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
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(sweep: Sequence[Configuration], steps: int = 10, rounds: int = 5,
        progress: Optional[Callable[[str], None]] = print, profile_steps: int = 0,
        profile_dir: str = "tfpar_profile") -> list[Measurement]:
    """Starts every configuration, then measures them in interleaved rounds.

    Args:
        sweep: The configurations (see :func:`configurations`).
        steps: Training steps per measured slice (at least two compiled calls).
        rounds: Measured rounds; each configuration runs one slice per round.
        progress: Called with a line of progress text; ``None`` for silence.
        profile_steps: After warm-up, every process traces this many steps for TensorBoard's
            profiler (not measured) into ``profile_dir/{model}_{strategy}_{devices}``
            (``_process{i}`` added for each process of a multi-process configuration).
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
                progress(f"starting {_describe(configuration)}")
            processes = _Processes(configuration, stack, profile_steps, profile_dir)
            running.append(processes)
            measurements.append(Measurement(configuration, processes.info["devices"],
                                            processes.info["training_flops_per_image"]))
        for round_index in range(rounds):
            order = list(range(len(sweep)))
            order = order[round_index % len(order):] + order[:round_index % len(order)]
            for i in order:
                images_per_second, all_reduce_seconds, steal = running[i].measure(steps)
                measurements[i].images_per_second.append(images_per_second)
                measurements[i].all_reduce_seconds.append(all_reduce_seconds)
                measurements[i].steal_fraction.append(steal)
                if progress:
                    progress(f"round {round_index + 1}/{rounds}: {_describe(sweep[i])} "
                             f"{measurements[i].images_per_second[-1]:.1f} images/s")
    return measurements


def _describe(c: Configuration) -> str:
    threads = ("default threads" if c.strategy == BASELINE
               else f"{c.threads_per_device} thread(s) each")
    return f"{c.model} {c.strategy} on {c.num_devices} device(s), {threads}"


def _smallest(m: Measurement, measurements: Sequence[Measurement]) -> Measurement:
    """The same strategy and model on its smallest device count."""
    return min((o for o in measurements if (o.strategy, o.model) == (m.strategy, m.model)),
               key=lambda o: len(o.devices))


def _rows(measurements: Sequence[Measurement]) -> list[dict]:
    rows = []
    for m in measurements:
        base = _smallest(m, measurements)
        speedup = paired_ratio(m, base)  # Over the smallest device count (itself: 1.00x).
        first = next(o for o in measurements if o.strategy != BASELINE
                     and (len(o.devices), o.model) == (len(m.devices), m.model)) \
            if m.strategy != BASELINE else m
        keras_run = next((o for o in measurements
                          if o.strategy == BASELINE and o.model == m.model), None)
        c = m.configuration
        # The same configuration without its all-reduce, measured in the same rounds.
        alone = next((o for o in measurements if not o.configuration.communication
                      and o.configuration == dataclasses.replace(c, communication=False)),
                     None) if c.communication else None
        rows.append({"model": m.model, "strategy": m.strategy, "num_devices": len(m.devices),
                     "devices": " ".join(m.devices),
                     "threads_per_device": 0 if m.strategy == BASELINE else c.threads_per_device,
                     "batch_size": c.step_batch_size, "dtype": c.dtype,
                     "images_per_second": m.median, "worst_images_per_second": m.worst,
                     "best_images_per_second": m.best, "spread": m.spread,
                     "steal": statistics.median(m.steal_fraction) if m.steal_fraction else 0.0,
                     "gflops_per_second": m.gflops_per_second,
                     "all_reduce_share": m.all_reduce_share,
                     "communication_in_step": (1 - paired_ratio(m, alone)) if alone else None,
                     "speedup": speedup,
                     "efficiency": speedup * len(base.devices) / len(m.devices),
                     "vs_first": paired_ratio(m, first),
                     "vs_keras": paired_ratio(m, keras_run) if keras_run else None})
    return rows


def write_csv(path: str, measurements: Sequence[Measurement]) -> None:
    """Writes one CSV row per configuration (the columns of :func:`table`), atomically."""
    import csv
    import io

    rows = _rows(measurements)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_io.write_text(path, text.getvalue())


def plot(path: str, measurements: Sequence[Measurement]) -> None:
    """Draws images/s and scaling efficiency against devices, a line per strategy and model.

    Needs matplotlib (``pip install -e ".[bench]"``). Written atomically as PNG.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = _rows(measurements)
    figure, (speed, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        if r["strategy"] == BASELINE:  # One configuration: a level to compare against.
            speed.axhline(r["images_per_second"], linestyle="--", color="gray",
                          label=f"{r['model']} plain Keras, all cores")
    for key in sorted({(r["model"], r["strategy"]) for r in rows if r["strategy"] != BASELINE}):
        line = sorted((r for r in rows if (r["model"], r["strategy"]) == key),
                      key=lambda r: r["num_devices"])
        devices = [r["num_devices"] for r in line]
        drawn = speed.plot(devices, [r["images_per_second"] for r in line], marker="o",
                           label=" ".join(key))
        # Every round as a small point: a configuration that alternates between two speeds
        # shows as two clusters, not as one median.
        for m in measurements:
            if (m.model, m.strategy) == key:
                speed.scatter([len(m.devices)] * len(m.images_per_second), m.images_per_second,
                              s=10, alpha=0.4, color=drawn[0].get_color())
        efficiency.plot(devices, [r["efficiency"] for r in line], marker="o",
                        label=" ".join(key))
    speed.set(xlabel="devices", ylabel="images/s (line: median round; dots: rounds)",
              title="Throughput")
    efficiency.set(xlabel="devices", ylabel="speedup / devices", title="Scaling efficiency",
                   ylim=(0, 1.2))
    for axes in (speed, efficiency):
        axes.set_xticks(sorted({r["num_devices"] for r in rows}))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    with atomic_io.atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)


def table(measurements: Sequence[Measurement], epoch_examples: int = 60_000) -> str:
    """Returns the results table.

    Columns: threads per device (``-``: TensorFlow's default, all cores), images/s (median
    round; the worst and best rounds beside it, so a configuration that alternates between
    two speeds shows at a glance), the machine's steal share (median over rounds), achieved training
    GFLOP/s, sec/epoch for ``epoch_examples`` images, the share of a step's time that one
    all-reduce of the gradients takes when timed alone (communication), the share it takes in
    context ("in step": 1 - the paired ratio to the same configuration without its all-reduce,
    where that was measured; what overlap did not hide), speedup over the same
    strategy and model on its smallest device count, scaling efficiency (speedup / devices),
    the ratio to the first strategy on the same device count and model (e.g. allreduce /
    mirrored), and to the plain Keras baseline. Ratios are paired: medians of per-round ratios.
    """
    header = ("model", "strategy", "devices", "threads", "images/s", "worst", "best", "steal",
              "GFLOP/s", "sec/epoch", "all-reduce", "in step", "speedup", "efficiency",
              "vs first", "vs keras")
    rows = [header]
    for m, r in zip(measurements, _rows(measurements)):
        rows.append((m.model, m.strategy, f"[{', '.join(m.devices)}]",
                     str(r["threads_per_device"] or "-"), f"{m.median:.1f}", f"{m.worst:.1f}",
                     f"{m.best:.1f}", f"{100 * r['steal']:.0f}%", f"{m.gflops_per_second:.1f}",
                     f"{epoch_examples / m.median:.1f}", f"{100 * m.all_reduce_share:.0f}%",
                     "-" if r["communication_in_step"] is None
                     else f"{100 * r['communication_in_step']:.0f}%",
                     f"{r['speedup']:.2f}x",
                     f"{r['efficiency']:.2f}", f"{r['vs_first']:.3f}",
                     "-" if r["vs_keras"] is None else f"{r['vs_keras']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, measurements: Sequence[Measurement]) -> None:
    """Writes every measurement (configuration, each round, median, best, spread), atomically."""
    atomic_io.write_json(path, [dict(dataclasses.asdict(m), median=m.median, worst=m.worst,
                                     best=m.best, spread=m.spread) for m in measurements])
