"""Tuning the thread layout to this machine: the candidate layouts
(:func:`tfpar.host.thread_layouts.candidates`; for a multi-process strategy, the worker
processes' :func:`tfpar.host.thread_layouts.worker_candidates`) timed for a model in paired,
interleaved rounds, and the fastest stored for this machine kind (``tfpar-benchmark --tune``).

The default layout is kept unless a candidate beats it by more than :data:`MARGIN` in the
median of the per-round ratios: a machine whose speed drifts between rounds then changes
nothing, and a layout is stored only where it measurably pays.

For a strategy of one process it also times one worker process per device on this host (the
multi-worker entry with the same step, as ``tfpar-launch`` runs it): which is faster
differs by CPU kind and model, and where the processes win, it says so (the user picks the
strategy; nothing is switched).

Beside the layouts it times the default layout with several steps per compiled call
(Keras's ``steps_per_execution``): the fixed cost of each call of a compiled step (Python,
dispatch, the start and end of a multi-device function) depends on the machine and the model,
and only that setting removes it. It is the model's setting, so it is reported and recorded
with the layout, and applied only where a run asks with ``steps_per_execution="auto"``; so is
the timing of ``mixed_bfloat16`` on a CPU that runs bfloat16 natively (``dtype="auto"``).
"""

from __future__ import annotations

import dataclasses

from tfpar.benchmark import runner
from tfpar.benchmark.measurements import Configuration
from tfpar.benchmark.measurements import Measurement
from tfpar.benchmark.measurements import paired_ratio
from tfpar.errors import ConfigError
from tfpar.host import machine
from tfpar.host import thread_layouts
from tfpar.strategies.registry import StrategyChoice

#: How much faster than the default (median of per-round ratios) a layout must be to be stored
#: as the machine's choice.
MARGIN = 1.02
#: The steps per compiled call timed beside the layouts (fewer if the rounds are shorter than
#: two such calls).
PROBED_STEPS_PER_EXECUTION = 8


@dataclasses.dataclass(frozen=True)
class Tuned:
    """What tuning measured for one device count.

    Attributes:
        num_devices: The device count.
        workers: Whether the devices are worker processes of one device each (a
            multi-process strategy) rather than logical devices of one process.
        layouts: The candidates, the default first.
        measurements: One per candidate, in the same order.
        ratios: Each candidate's paired ratio to the default (images/s).
        chosen: The index of the layout stored.
        path: Where it was stored.
        per_call: The default layout with several steps per compiled call: the steps per
            call, its measurement and its paired ratio to the default (``None`` if not timed).
        processes: One worker process per device: the multi-worker entry, its measurement
            and its paired ratio to the default (``None`` if not timed).
        precision: The default layout in ``mixed_bfloat16`` (timed where the CPU computes
            bfloat16 natively): the policy, its measurement and its paired ratio to the
            default (``None`` if not timed).
    """

    num_devices: int
    workers: bool
    layouts: list[thread_layouts.ThreadLayout]
    measurements: list[Measurement]
    ratios: list[float]
    chosen: int
    path: str
    per_call: tuple[int, Measurement, float] | None = None
    processes: tuple[str, Measurement, float] | None = None
    precision: tuple[str, Measurement, float] | None = None

    def lines(self) -> list[str]:
        """The result for people: a line per candidate, the stored one marked."""
        unit = "workers on one host" if self.workers else "devices"
        out = [f"Thread layouts for {self.num_devices} {unit} "
               f"({self.measurements[0].model}, {self.measurements[0].strategy}):"]
        devices_per_process = 1 if self.workers else self.num_devices
        for i, (layout, m, ratio) in enumerate(zip(self.layouts, self.measurements,
                                                   self.ratios)):
            mark = "  <- stored" if i == self.chosen else ""
            out.append(f"  {layout.describe(devices_per_process):55s} {m.median:9.1f} img/s  "
                       f"{ratio:5.2f}x default{mark}")
        if self.per_call is not None:
            steps, m, ratio = self.per_call
            out.append(f"  {f'the default, {steps} steps per compiled call':55s} "
                       f"{m.median:9.1f} img/s  {ratio:5.2f}x default")
            out.append(f"  each compiled call costs {1 - 1 / ratio:.0%} of a step's time here: "
                       f"compile(steps_per_execution={steps}) (--steps_per_execution={steps}) "
                       "removes it" if ratio > MARGIN else
                       f"  {steps} steps per compiled call gain nothing measurable here")
        if self.precision is not None:
            policy, m, ratio = self.precision
            out.append(f"  {f'the default in {policy}':55s} {m.median:9.1f} img/s  "
                       f"{ratio:5.2f}x default")
            out.append(f"  {policy} pays here: --dtype=auto chooses it" if ratio > MARGIN else
                       f"  {policy} gains nothing measurable here: --dtype=auto keeps float32")
        if self.processes is not None:
            name, m, ratio = self.processes
            out.append(f"  {f'one process per device ({name})':55s} {m.median:9.1f} img/s  "
                       f"{ratio:5.2f}x default")
            if ratio > MARGIN:
                out.append(f"  one process per device pays here: tfpar-launch "
                           f"--num_workers={self.num_devices} -- <your command with "
                           f"strategy {name}>")
        out.append(f"  stored in {self.path} for this machine kind")
        return out


def tune(base: Configuration, steps: int, rounds: int) -> Tuned:
    """Times every candidate layout of ``base``'s device count and stores the winner, with what
    several steps per compiled call and one process per device gain (see the module
    docstring).

    Args:
        base: The configuration to tune (strategy, model, batch, device count > 1).
        steps: Measured steps per round.
        rounds: Rounds (interleaved across the candidates).

    Returns:
        What was measured and stored.
    """
    if not isinstance(base.strategy, StrategyChoice):
        raise ConfigError(f"Tuning times a registry strategy's thread layouts, not "
                          f"{base.strategy.name!r}. Give a registry strategy, e.g. mirrored.")
    workers = base.strategy.multi_process
    layouts = (thread_layouts.worker_candidates(base.num_devices) if workers
               else thread_layouts.candidates(base.num_devices))
    sweep = [dataclasses.replace(base, threads_per_device=layout.threads_per_device,
                                 per_device_pools=layout.per_device_pools,
                                 inter_op_threads=layout.inter_op_threads)
             for layout in layouts]
    per_call_steps = min(PROBED_STEPS_PER_EXECUTION, steps // 2)
    probed = base.steps_per_execution == 1 and per_call_steps >= 2
    if probed:
        sweep.append(dataclasses.replace(sweep[0], steps_per_execution=per_call_steps))
    low_precision = base.dtype == "float32" and machine.cpu()["native_bfloat16"].startswith(
        "yes")
    if low_precision:
        sweep.append(dataclasses.replace(sweep[0], dtype="mixed_bfloat16"))
    processes = (base.strategy.one_process_per_device()
                 if not workers and base.steps_per_execution == 1 else None)
    if processes:
        sweep.append(dataclasses.replace(sweep[0], strategy=processes, options=()))
    measurements = runner.run(sweep, steps=steps, rounds=rounds)
    ratios = [paired_ratio(m, measurements[0]) for m in measurements]
    by_processes = (processes.name, measurements.pop(), ratios.pop()) if processes else None
    precision = (("mixed_bfloat16", measurements.pop(), ratios.pop()) if low_precision
                 else None)
    per_call = (per_call_steps, measurements.pop(), ratios.pop()) if probed else None
    best = max(range(len(layouts)), key=lambda i: ratios[i])
    chosen = best if ratios[best] > MARGIN else 0
    evidence: dict = {}
    if per_call:
        evidence["steps_per_execution"] = {str(per_call[0]): round(per_call[2], 3)}
    if by_processes:
        evidence["one_process_per_device"] = {by_processes[0]: round(by_processes[2], 3)}
    if precision:
        evidence["dtype"] = {precision[0]: round(precision[2], 3)}
    key = thread_layouts.workers_key(base.num_devices) if workers else base.num_devices
    path = thread_layouts.store(key, layouts[chosen], model=base.model,
                                strategy=base.strategy.name, speedup=round(ratios[chosen], 3),
                                rounds=rounds, **evidence)
    return Tuned(base.num_devices, workers, layouts, measurements, ratios, chosen, path,
                 per_call, by_processes, precision)
