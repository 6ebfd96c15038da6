"""The benchmark's results for people and tools: the table, CSV, JSON and the PNG."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from tfpar import atomic_io
from tfpar.benchmark import scaling_model
from tfpar.benchmark.measurements import Measurement
from tfpar.benchmark.measurements import paired_ratio


def _smallest(m: Measurement, measurements: Sequence[Measurement]) -> Measurement:
    """The same strategy and model on its smallest device count."""
    return min((o for o in measurements if (o.strategy, o.model) == (m.strategy, m.model)),
               key=lambda o: len(o.devices))


def _rows(measurements: Sequence[Measurement]) -> list[dict]:
    rows = []
    for m in measurements:
        base = _smallest(m, measurements)
        speedup = paired_ratio(m, base)  # Over the smallest device count (itself: 1.00x).
        first = next(o for o in measurements if not o.is_baseline
                     and (len(o.devices), o.model) == (len(m.devices), m.model)) \
            if not m.is_baseline else m
        keras_run = next((o for o in measurements
                          if o.is_baseline and o.model == m.model), None)
        c = m.configuration
        # The same configuration without its all-reduce, measured in the same rounds.
        alone = next((o for o in measurements if not o.configuration.communication
                      and o.configuration == dataclasses.replace(c, communication=False)),
                     None) if c.communication else None
        rows.append({"model": m.model, "strategy": m.strategy, "num_devices": len(m.devices),
                     "devices": " ".join(m.devices),
                     "threads_per_device": 0 if m.is_baseline else c.threads_per_device,
                     "batch_size": c.step_batch_size, "dtype": c.dtype,
                     "images_per_second": m.median, "worst_images_per_second": m.worst,
                     "best_images_per_second": m.best, "spread": m.spread,
                     "steal": statistics.median(m.steal_fraction) if m.steal_fraction else 0.0,
                     "gflops_per_second": m.gflops_per_second,
                     "all_reduce_share": m.all_reduce_share,
                     "startup_seconds": m.startup_seconds,
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

    Needs matplotlib (``pip install matplotlib``). Written atomically as PNG.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = _rows(measurements)
    figure, (speed, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    for m, r in zip(measurements, rows):
        if m.is_baseline:  # One configuration: a level to compare against.
            speed.axhline(r["images_per_second"], linestyle="--", color="gray",
                          label=f"{r['model']} plain Keras, all cores")
    for key in sorted({(r["model"], r["strategy"]) for m, r in zip(measurements, rows)
                       if not m.is_baseline}):
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
    where that was measured; what overlap did not hide), start-up (seconds from starting the
    processes to the end of the first step), speedup over the same
    strategy and model on its smallest device count, scaling efficiency (speedup / devices),
    the ratio to the first strategy on the same device count and model (e.g. allreduce /
    mirrored), and to the plain Keras baseline. Ratios are paired: medians of per-round ratios.
    """
    header = ("model", "strategy", "devices", "threads", "images/s", "worst", "best", "steal",
              "GFLOP/s", "sec/epoch", "all-reduce", "in step", "start-up", "speedup", "efficiency",
              "vs first", "vs keras")
    rows = [header]
    for m, r in zip(measurements, _rows(measurements)):
        rows.append((m.model, m.strategy, f"[{', '.join(m.devices)}]",
                     str(r["threads_per_device"] or "-"), f"{m.median:.1f}", f"{m.worst:.1f}",
                     f"{m.best:.1f}", f"{100 * r['steal']:.0f}%", f"{m.gflops_per_second:.1f}",
                     f"{epoch_examples / m.median:.1f}", f"{100 * m.all_reduce_share:.0f}%",
                     "-" if r["communication_in_step"] is None
                     else f"{100 * r['communication_in_step']:.0f}%",
                     "-" if math.isnan(m.startup_seconds) else f"{m.startup_seconds:.1f} s",
                     f"{r['speedup']:.2f}x",
                     f"{r['efficiency']:.2f}", f"{r['vs_first']:.3f}",
                     "-" if r["vs_keras"] is None else f"{r['vs_keras']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, measurements: Sequence[Measurement]) -> None:
    """Writes every measurement (configuration, each round, median, best, spread), atomically."""
    atomic_io.write_json(path, [
        {**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)},
         "configuration": m.configuration.to_dict(), "median": m.median, "worst": m.worst,
         "best": m.best, "spread": m.spread} for m in measurements])


def scaling_lines(measurements: Sequence[Measurement],
                  predict_at: Sequence[int] = (16, 32, 256)) -> list[str]:
    """The all-reduce model (:mod:`.scaling_model`, ring) fitted to each multi-worker entry
    measured at two or more worker counts, with its prediction at ``predict_at`` workers on the
    network measured: one line each (none without such measurements)."""
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        if m.configuration.num_processes > 1 and any(m.all_reduce_seconds):
            groups.setdefault((m.model, m.strategy), []).append(m)
    lines = []
    for (model, strategy), group in groups.items():
        measured = sorted((m.configuration.num_processes, statistics.median(m.all_reduce_seconds))
                          for m in group)
        if len({n for n, _ in measured}) < 2:
            continue
        size = group[0].gradient_bytes
        network = scaling_model.fit(measured, size)
        bandwidth = ("bandwidth not resolved (the times are latency)"
                     if math.isinf(network.bandwidth)
                     else f"{network.bandwidth / 1e9:.2f} GB/s")
        predicted = ", ".join(f"{1e3 * scaling_model.predict(network, n, size):.1f} ms"
                              for n in predict_at)
        lines.append(
            f"All-reduce model of {model} {strategy} (ring, {size / 1e6:.2f} MB of gradients, "
            f"fitted to {', '.join(str(n) for n, _ in measured)} workers): "
            f"{1e3 * network.latency:.2f} ms a message, {bandwidth}; at "
            f"{', '.join(map(str, predict_at))} workers on this network: {predicted}.")
    return lines
