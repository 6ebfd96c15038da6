"""Tuning the thread layout to this machine: the candidate layouts
(:func:`tfpar.thread_layouts.candidates`) timed for a model in paired, interleaved rounds, and
the fastest stored for this machine kind (``scripts/benchmark.py --tune``).

The default layout is kept unless a candidate beats it by more than :data:`MARGIN` in the
median of the per-round ratios: a machine whose speed drifts between rounds then changes
nothing, and a layout is stored only where it measurably pays.
"""

from __future__ import annotations

import dataclasses

from tfpar import thread_layouts
from tfpar.benchmark import runner
from tfpar.benchmark.configuration import Configuration
from tfpar.benchmark.configuration import Measurement
from tfpar.benchmark.configuration import paired_ratio

#: How much faster than the default (median of per-round ratios) a layout must be to be stored
#: as the machine's choice.
MARGIN = 1.02


@dataclasses.dataclass(frozen=True)
class Tuned:
    """What tuning measured for one device count.

    Attributes:
        num_devices: The device count.
        layouts: The candidates, the default first.
        measurements: One per candidate, in the same order.
        ratios: Each candidate's paired ratio to the default (images/s).
        chosen: The index of the layout stored.
        path: Where it was stored.
    """

    num_devices: int
    layouts: list[thread_layouts.ThreadLayout]
    measurements: list[Measurement]
    ratios: list[float]
    chosen: int
    path: str

    def lines(self) -> list[str]:
        """The result for people: a line per candidate, the stored one marked."""
        out = [f"Thread layouts for {self.num_devices} devices "
               f"({self.measurements[0].model}, {self.measurements[0].configuration.strategy}):"]
        for i, (layout, m, ratio) in enumerate(zip(self.layouts, self.measurements,
                                                   self.ratios)):
            mark = "  <- stored" if i == self.chosen else ""
            out.append(f"  {layout.describe(self.num_devices):55s} {m.median:9.1f} img/s  "
                       f"{ratio:5.2f}x default{mark}")
        out.append(f"  stored in {self.path} for this machine kind")
        return out


def tune(base: Configuration, steps: int, rounds: int) -> Tuned:
    """Times every candidate layout of ``base``'s device count and stores the winner.

    Args:
        base: The configuration to tune (strategy, model, batch, device count > 1).
        steps: Measured steps per round.
        rounds: Rounds (interleaved across the candidates).

    Returns:
        What was measured and stored.
    """
    layouts = thread_layouts.candidates(base.num_devices)
    sweep = [dataclasses.replace(base, threads_per_device=layout.threads_per_device,
                                 per_device_pools=layout.per_device_pools,
                                 inter_op_threads=layout.inter_op_threads)
             for layout in layouts]
    measurements = runner.run(sweep, steps=steps, rounds=rounds)
    ratios = [paired_ratio(m, measurements[0]) for m in measurements]
    best = max(range(len(layouts)), key=lambda i: ratios[i])
    chosen = best if ratios[best] > MARGIN else 0
    path = thread_layouts.store(base.num_devices, layouts[chosen], model=base.model,
                                strategy=base.strategy, speedup=round(ratios[chosen], 3),
                                rounds=rounds)
    return Tuned(base.num_devices, layouts, measurements, ratios, chosen, path)
