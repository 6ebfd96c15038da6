"""What the benchmark measures: configurations, their measurements and paired ratios.

A configuration is a strategy x device count x model (x dtype, XLA, steps per call, options);
:func:`configurations` builds a sweep of them. A :class:`Measurement` holds one
configuration's rounds. Ratios between configurations are *paired* (:func:`paired_ratio`): the
median over rounds of the per-round ratio, so a machine that changes speed between rounds
cancels out. No TensorFlow at import (the command line checks its flags with it).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

from tfpar import strategies
from tfpar.host import thread_layouts
from tfpar.strategies.registry import StrategyChoice


class _NamedRun:
    """A run that is not a registry strategy (the benchmark's BASELINE and CEILING), equal
    only to a run of its kind."""

    name: ClassVar[str]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, eq=False)
class PlainKeras(_NamedRun):
    """What a configuration runs: plain Keras with no strategy on one device and TensorFlow's
    default threads (every core)."""

    name: ClassVar[str] = "keras"

    def processes(self, num_devices: int) -> int:
        """Processes it runs as: one."""
        return 1


@dataclasses.dataclass(frozen=True, eq=False)
class Ceiling(_NamedRun):
    """What a configuration runs: N processes each training plain Keras alone on one device of
    ``threads_per_device`` threads and 1/N of the global batch (a replica's share), side by
    side: data parallelism with no communication at all, the most N devices can give."""

    name: ClassVar[str] = "independent"

    def processes(self, num_devices: int) -> int:
        """Processes it runs as: one per device."""
        return num_devices


BASELINE = PlainKeras()
"""The plain single-device Keras configuration's run (its name: ``"keras"``)."""
CEILING = Ceiling()
"""The independent processes' run, the ceiling (its name: ``"independent"``)."""

Runs = StrategyChoice | PlainKeras | Ceiling
"""What a configuration runs: a registry strategy with its options, plain Keras, or the
ceiling."""


def _runs(value: Runs | str, options: tuple[tuple[str, Any], ...]) -> Runs:
    """``value`` as what a configuration runs: a name is resolved (``"keras"``,
    ``"independent"`` or a registry entry with ``options``)."""
    if not isinstance(value, str):
        return value
    if value == PlainKeras.name:
        return BASELINE
    if value == Ceiling.name:
        return CEILING
    return strategies.choose(value, **dict(options))


@dataclasses.dataclass(frozen=True)
class Configuration:
    """What one measured configuration trains, and on what.

    Attributes:
        strategy: What it runs (:data:`Runs`): a :class:`tfpar.strategies.StrategyChoice`,
            :data:`BASELINE` (plain Keras with no strategy) or :data:`CEILING`
            (``num_devices`` plain Keras processes side by side). A name is resolved on
            construction (``"keras"``, ``"independent"``, or a registry entry with
            ``options``).
        options: The options the sweep set, as ``(name, value)`` pairs (shown in
            :attr:`label`; a registry entry's are in ``strategy`` too).
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
        per_device_pools: Each logical device has an intra-op pool of its own (else one
            shared pool); several devices in one process only.
        inter_op_threads: Inter-op threads (``None``: one per device).
    """

    strategy: Runs
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
    per_device_pools: bool = True
    inter_op_threads: int | None = None

    def __post_init__(self):
        runs = _runs(self.strategy, self.options)
        object.__setattr__(self, "strategy", runs)

    @property
    def thread_layout(self) -> thread_layouts.ThreadLayout:
        """The thread layout of each of its processes."""
        return thread_layouts.ThreadLayout(self.threads_per_device, self.per_device_pools,
                                           self.inter_op_threads)

    @property
    def num_processes(self) -> int:
        """Processes this configuration runs as: one per device for the ceiling and for
        multi-process strategies (one worker per device), else one."""
        if isinstance(self.strategy, StrategyChoice):
            return self.num_devices if self.strategy.multi_process else 1
        return self.strategy.processes(self.num_devices)

    @property
    def step_batch_size(self) -> int:
        """Images of one step (one update): ``batch_size`` times the micro-batches."""
        micro_batches = (self.strategy.micro_batches if isinstance(self.strategy, StrategyChoice)
                         else 1)
        return self.batch_size * micro_batches

    @property
    def label(self) -> str:
        """The strategy with its options, e.g. ``allreduce(algorithm=ring)``."""
        parts = [f"{k}={v}" for k, v in self.options] + (
            [] if self.communication else ["no all-reduce"])
        name = self.strategy.name
        return f"{name}({','.join(parts)})" if parts else name

    @property
    def description(self) -> str:
        """For progress lines, e.g. ``lenet mirrored on 2 device(s), 1 thread(s) each``."""
        threads = ("default threads" if isinstance(self.strategy, PlainKeras)
                   else f"{self.threads_per_device} thread(s) each" if (
                       self.per_device_pools and self.inter_op_threads is None)
                   else self.thread_layout.describe(self.num_devices))
        return f"{self.model} {self.strategy.name} on {self.num_devices} device(s), {threads}"

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values: what it runs as its name, with every option
        of a registry entry under ``entry_options``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["strategy"] = self.strategy.name
        fields["entry_options"] = (dict(self.strategy.options)
                                   if isinstance(self.strategy, StrategyChoice) else {})
        return fields

    def to_json(self) -> str:
        """The configuration as JSON (the worker's command-line argument; see
        :meth:`to_dict`)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Configuration:
        """Inverse of :meth:`to_json` (a worker process resolves the name anew)."""
        fields = json.loads(text)
        entry_options = fields.pop("entry_options")
        fields["image_shape"] = tuple(fields["image_shape"])
        fields["options"] = tuple((k, tuple(v) if isinstance(v, list) else v)
                                  for k, v in fields["options"])
        fields["strategy"] = _runs(fields["strategy"], tuple(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in entry_options.items()))
        return cls(**fields)


@dataclasses.dataclass
class Measurement:
    """The images/s of one configuration over the measurement rounds.

    Attributes:
        configuration: What was measured.
        devices: The replicas' devices (``worker:1/CPU:0`` for other workers' devices).
        training_flops_per_image: FLOPs of one training step per image (see tfpar.benchmark.flops).
        images_per_second: One figure per round.
        all_reduce_seconds: Per round, the time of one all-reduce of the model's gradients
            through the strategy alone: the communication in every step.
        steal_fraction: Per round, the share of the machine's CPU time that the hypervisor
            gave to other guests ("steal" in ``/proc/stat``) while the slice ran: where it is
            high, the round measured a throttled machine, not the configuration.
        startup_seconds: From starting the configuration's processes to the end of its first
            step (of the chief's, for a job of several workers): imports, devices, connecting
            the workers, building the model, tracing the step. Measured while the
            configurations started before it sit idle; ``nan`` when not measured.
        gradient_bytes: The bytes of the model's gradients (its trainable variables): what an
            all-reduce exchanges each step.
    """

    configuration: Configuration
    devices: list[str]
    training_flops_per_image: int = 0
    images_per_second: list[float] = dataclasses.field(default_factory=list)
    all_reduce_seconds: list[float] = dataclasses.field(default_factory=list)
    steal_fraction: list[float] = dataclasses.field(default_factory=list)
    startup_seconds: float = math.nan
    gradient_bytes: int = 0

    @property
    def strategy(self) -> str:
        """What was run, by name with its options (see ``Configuration.label``)."""
        return self.configuration.label

    @property
    def model(self) -> str:
        """The model's name."""
        return self.configuration.model

    @property
    def is_baseline(self) -> bool:
        """Whether it measured plain Keras (:data:`BASELINE`)."""
        return isinstance(self.configuration.strategy, PlainKeras)

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
                   threads_per_device: int | None = None, baseline: bool = False,
                   ceiling: bool = False,
                   strategy_options: Mapping[str, Sequence[Any]] | None = None,
                   communication_share: bool = False, **options: Any) -> list[Configuration]:
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
        threads_per_device = thread_layouts.default(max(device_counts)).threads_per_device
    sweep = [Configuration(BASELINE, 1, m, batch_size, **options)
             for m in model_names] if baseline else []
    pairs = [(choice.with_options(**dict(o)), o)
             for choice in map(strategies.choose, strategy_names)
             for o in _option_sets(choice, strategy_options or {})]
    variants: list[tuple[Runs, tuple, bool]] = [(s, o, True) for s, o in pairs] + (
        [(s, o, False) for s, o in pairs if s.runs_allreduce_step]
        if communication_share else [])
    variants += [(CEILING, (), True)] if ceiling else []
    return sweep + [Configuration(s, n, m, batch_size, options=o, communication=c,
                                  **{"threads_per_device": threads_per_device, **options,
                                     **_virtual_replicas_threads(o, n, threads_per_device)})
                    for m in model_names for s, o, c in variants for n in device_counts]


def _virtual_replicas_threads(options: tuple[tuple[str, Any], ...], num_devices: int,
                              threads_per_device: int) -> dict[str, Any]:
    """With ``virtual_replicas``, the threads ``tfpar-train`` gives the mode (one per device,
    an inter-op thread per core: :func:`tfpar.host.thread_layouts.for_virtual_replicas`),
    where the sweep's share per device is more than one thread."""
    if not dict(options).get("virtual_replicas") or threads_per_device == 1:
        return {}
    layout = thread_layouts.for_virtual_replicas(num_devices)
    return {"threads_per_device": layout.threads_per_device,
            "inter_op_threads": layout.inter_op_threads}


def _option_sets(choice: StrategyChoice, values: Mapping[str, Sequence[Any]]
                 ) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the swept values of the options ``choice``'s entry takes."""
    taken = [name for name in choice.options if name in values]
    return [tuple(zip(taken, combination))
            for combination in itertools.product(*(values[name] for name in taken))]


def chosen_for_the_machine(sweep: Sequence[Configuration], dtype: bool,
                           steps_per_execution: bool) -> tuple[list[Configuration], list[str]]:
    """``sweep`` with the precision and/or steps per compiled call that
    :func:`tfpar.training.recommend` chooses on this machine for each configuration's devices
    (the benchmark's ``--dtype=auto`` and ``--steps_per_execution=auto``).

    Plain Keras and the independent processes of a device count run at what was chosen for
    the first strategy of that count (else for one device), so every ratio compares equal
    settings.

    Args:
        sweep: The configurations (their own dtype and steps per call are replaced).
        dtype: Choose the precision.
        steps_per_execution: Choose the steps per compiled call.

    Returns:
        The configurations, and one line per distinct choice saying what and why.
    """
    from tfpar.training import recommendations  # The training layer: imported when asked.

    chosen: dict[tuple[int, int], tuple[dict[str, Any], str]] = {}

    def choice(count: int, workers: int) -> tuple[dict[str, Any], str]:
        if (count, workers) not in chosen:
            changes, said = recommendations.chosen({"CPU"}, count, workers, dtype=dtype,
                                                   steps_per_execution=steps_per_execution)
            where = f"{workers} worker processes" if workers > 1 else f"{count} device(s)"
            chosen[count, workers] = changes, f"Chosen for {where}: {said}."
        return chosen[count, workers]

    for_strategies: dict[int, dict[str, Any]] = {}
    for c in sweep:
        if isinstance(c.strategy, StrategyChoice):
            workers = c.num_processes
            for_strategies.setdefault(c.num_devices, choice(
                c.num_devices if workers == 1 else 1, workers)[0])
    resolved = []
    for c in sweep:
        if not isinstance(c.strategy, StrategyChoice):
            changes = for_strategies.get(c.num_devices) or choice(1, 1)[0]
        else:
            workers = c.num_processes
            changes = choice(c.num_devices if workers == 1 else 1, workers)[0]
        resolved.append(dataclasses.replace(c, **changes))
    return resolved, [line for _, line in chosen.values()]
