"""The docs' tables of benchmark results, generated from the results files in
``benchmarks/results/`` (written by the benchmarks' ``--out``), so that every figure they show
has a source.

Figures measured before results files were kept are in ``history_NAME.json`` files (each the
block of the page it fills, as copied by hand from the run's printed output, said in its
caption). A page holds a generated block as::

    <!-- results: saving -->
    ...the table, as this script renders it...
    <!-- /results -->

and this script fills every such block of the docs from the results files of its kind (every
file whose name starts with the kind, newest first), each table captioned with its files, CPU
kind, versions and command. ``--check`` fails (exit 1) where a page differs from what the files
render, as the docs test does; either way a measured figure outside the generated blocks (a
number with a unit, or a decimal, outside headings and code) fails.

Usage::

    python benchmarks/page.py [--check]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGES = ("docs/benchmarks.md",)
BLOCK = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)<!-- /results -->", re.S)


def results(kind: str) -> list[tuple[str, dict[str, Any]]]:
    """The results files of ``kind`` (their names start with it), newest first (of one day,
    in reverse order of their names)."""
    files = []
    for path in sorted(glob.glob(os.path.join(RESULTS, f"{kind}_*.json"))):
        with open(path, encoding="utf-8") as f:
            files.append((os.path.relpath(path, ROOT), json.load(f)))
    # Newest first; of one day, by name from the end (a run's newer files are named so).
    return sorted(files, key=lambda item: (item[1]["date"], item[0]), reverse=True)


def _caption(path: str, run: dict[str, Any]) -> str:
    flags = ", ".join(f"{name}={value}" for name, value in run["flags"].items()
                      if value != "unset") or "no kernel flags set"
    versions = run["versions"]
    return (f"`{path}`: {run['cpu']}; TensorFlow {versions['tensorflow']}, Keras "
            f"{versions['keras']}, tfpar {versions['tfpar']}; {flags}; {run['date']}; "
            f"`{run['command']}`")


def _mode(mode: str, entry: dict[str, Any], chosen: bool) -> str:
    """A mode's row heading: its interval and how its saves were written (``chosen``: a mode
    without ``:sync`` or ``:background`` let ``EpochCheckpoint`` choose; before it could, it
    wrote in the background)."""
    every, _, way = mode.partition(":")
    words = {"none": "none", "auto": "`auto` (2% budget)"}.get(
        every, f"every {every} step{'s' if every != '1' else ''}")
    if way:
        return words + (", within the step" if way == "sync" else ", in the background")
    if not chosen:
        return words + ", in the background"
    return (f"{words}, the way chosen ({entry['in_background']} of {entry['saves']} saves in "
            "the background)")


def _table(title: str, header: list[str], rows: list[list[str]], path: str,
           run: dict[str, Any]) -> list[str]:
    """A results table's lines: its title, header and rows, then the caption of its file."""
    return [title, "", "| " + " | ".join(header) + " |",
            "| " + " | ".join(["---"] * len(header)) + " |",
            *("| " + " | ".join(row) + " |" for row in rows), "", _caption(path, run), ""]


def _paired(median: float, low: float, high: float, digits: int = 2, bold: bool = False) -> str:
    """A paired ratio: the median of the per-round ratios, the rounds' range in brackets."""
    figure = f"{median:.{digits}f}"
    return f"{f'**{figure}**' if bold else figure} ({low:.{digits}f}-{high:.{digits}f})"


def _per_round(measurement: dict[str, Any], reference: dict[str, Any]) -> str:
    """``measurement``'s images/s over ``reference``'s, paired by round (see :func:`_paired`)."""
    ratios = [m / r for m, r in zip(measurement["images_per_second"],
                                    reference["images_per_second"])]
    return _paired(statistics.median(ratios), min(ratios), max(ratios), bold=True)


def render_saving(files: list[tuple[str, dict[str, Any]]]) -> str:
    """What saving inside an epoch costs (``benchmarks/saving.py``)."""
    lines = []
    for path, run in files:
        devices = f"{run['devices']} device{'s' if run['devices'] != 1 else ''}"
        if run.get("workers", 1) > 1:
            devices = f"{run['workers']} worker processes of {devices} each"
        chosen = run.get("default_write") == "auto"
        rows = []
        for mode, entry in run["summary"].items():
            if mode == "none":
                continue
            every, _, way = mode.partition(":")
            within = way == "sync" or (chosen and not way and not entry["in_background"])
            step = entry["step_seconds"]
            if every == "auto":
                interval = entry.get("interval") or 0
                if interval and interval < run["steps"]:
                    steps = interval + entry["write_seconds"] / step
                    loses = f"{steps:.1f} steps, {steps * step:.1f} s (every {interval})"
                else:  # Saved at epochs' ends only.
                    steps = run["steps"] + entry["write_seconds"] / step
                    loses = (f"{steps:.1f} steps, {steps * step:.1f} s (at epochs' ends: every "
                             f"{interval} is an epoch or longer)")
            else:
                steps = int(every) + (0 if within else entry["write_seconds"] / step)
                loses = f"{steps:.1f} steps, {steps * step:.1f} s"
            rows.append([_mode(mode, entry, chosen),
                         _paired(entry["throughput_ratio"], *entry["ratio_range"], digits=3),
                         f"{entry['held_seconds_per_save'] * 1000:.1f} ms",
                         f"{entry['write_seconds'] * 1000:.0f} ms"
                         + (" (within the step)" if within else ""), loses])
        lines += _table(f"{run['model']}, global batch {run['batch']}, {run['steps']} steps an "
                        f"epoch on {devices} ({run['entry']}), {len(run['rounds'])} rounds:",
                        ["saving", "throughput of no saving (median, rounds)",
                         "step held per save", "a write", "a kill loses at most"],
                        rows, path, run)
    return "\n".join(lines)


def render_keras_distribution(files: list[tuple[str, dict[str, Any]]]) -> str:
    """``keras.distribution.DataParallel`` against its entry (``keras_distribution.py``)."""
    lines = []
    for path, run in files:
        ratios = [r["entry_seconds"] / r["keras_distribution_seconds"] for r in run["rounds"]]
        lines += [f"The entry's time over `DataParallel`'s: median **{run['median_ratio']:.3f}** "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f}).", "",
                  _caption(path, run), ""]
    return "\n".join(lines)


def _threads(configuration: dict[str, Any]) -> str:
    """A configuration's threads in words (of each process: a worker of a multi-process entry
    has one device)."""
    workers = configuration["strategy"].startswith("multi_worker")
    local = 1 if workers else configuration["num_devices"]
    inter = configuration["inter_op_threads"] or local
    return (f"{configuration['threads_per_device']} intra-op thread(s) per device, {inter} "
            f"inter-op{' in each worker process' if workers else ''}")


def render_world_size_invariance(files: list[tuple[str, dict[str, Any]]]) -> str:
    """What ``virtual_replicas`` costs against the default step (``tfpar-benchmark
    --virtual_replicas=0,V``, kept by ``record.py``)."""
    lines = []
    for path, run in files:
        by_key: dict[tuple[int, int], dict[str, Any]] = {}
        for measurement in run["measurements"]:
            configuration = measurement["configuration"]
            by_key[(configuration["num_devices"],
                    configuration["entry_options"]["virtual_replicas"])] = measurement
        first = run["measurements"][0]["configuration"]
        rounds = len(run["measurements"][0]["images_per_second"])
        rows = [[str(devices), _threads(by_key[(devices, 0)]["configuration"]),
                 f"{by_key[(devices, 0)]['median']:.0f}",
                 f"{_threads(measurement['configuration'])} (V={virtual})",
                 f"{measurement['median']:.0f}", _per_round(measurement, by_key[(devices, 0)])]
                for (devices, virtual), measurement in sorted(by_key.items())
                if virtual and (devices, 0) in by_key]
        lines += _table(f"{first['model']}, global batch {first['batch_size']}, "
                        f"`{first['strategy']}`, {rounds} rounds:",
                        ["devices", "default: threads", "images/s",
                         "`virtual_replicas`: threads", "images/s",
                         "vs default (median, rounds)"], rows, path, run)
    return "\n".join(lines)


def _label(configuration: dict[str, Any]) -> str:
    """A configuration in words: its entry (and options), replicas and threads."""
    options = [f"{name}={value}" for name, value in configuration["options"]]
    if not configuration["communication"]:
        options.append("its step without the all-reduce")
    name = configuration["strategy"]
    entry = f"`{name}`" + (f" ({', '.join(options)})" if options else "")
    processes = name.startswith("multi_worker") or name == "independent"
    unit = "processes" if processes else "devices"
    return f"{entry}, {configuration['num_devices']} {unit}"


def render_processes(files: list[tuple[str, dict[str, Any]]]) -> str:
    """Entries against the ceiling (independent processes), paired (``tfpar-benchmark
    --ceiling``, kept by ``record.py``)."""
    lines = []
    for path, run in files:
        measurements = run["measurements"]
        ceiling = next(m for m in measurements
                       if m["configuration"]["strategy"] == "independent")
        first = measurements[0]["configuration"]
        rows = []
        for measurement in measurements:
            configuration = measurement["configuration"]
            step = configuration["batch_size"] / measurement["median"]
            share = (f"{statistics.median(measurement['all_reduce_seconds']) / step:.0%}"
                     if configuration["communication"] else "none run")
            rows.append([_label(configuration),
                         f"{measurement['median']:.0f} ({measurement['worst']:.0f}-"
                         f"{measurement['best']:.0f})", _per_round(measurement, ceiling), share])
        lines += _table(f"{first['model']}, global batch {first['batch_size']}, "
                        f"{len(ceiling['images_per_second'])} rounds, "
                        f"{first['steps_per_execution']} step(s) per call:",
                        ["configuration", "images/s (median, worst-best)",
                         "vs the ceiling (median, rounds)",
                         "all-reduce timed alone, share of a step"], rows, path, run)
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[list[tuple[str, dict[str, Any]]]], str]] = {
    "processes": render_processes,
    "saving": render_saving, "keras_distribution": render_keras_distribution,
    "world_size_invariance": render_world_size_invariance}


HISTORY = "history_"
"""The kind of a results file that holds figures copied by hand from a run's printed output
(its rounds not kept): one file per block, ``history_NAME.json``, rendered as it holds them."""


def render_history(kind: str) -> str:
    """The block a history file holds, captioned with where its figures come from."""
    path = os.path.join(RESULTS, f"{kind}.json")
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    return (f"{run['markdown']}\n\n`{os.path.relpath(path, ROOT)}`: {run['cpu']}; "
            f"{run['date']}. {run['provenance']}\n")


def rendered(text: str) -> str:
    """``text`` with every generated block rendered from the results files."""
    def block(match: re.Match) -> str:
        kind = match.group(2)
        if kind.startswith(HISTORY):
            return f"{match.group(1)}{render_history(kind)}<!-- /results -->"
        if kind not in RENDERERS:
            raise KeyError(f"no results of kind {kind!r}: known are {', '.join(RENDERERS)}")
        return f"{match.group(1)}{RENDERERS[kind](results(kind))}<!-- /results -->"

    return BLOCK.sub(block, text)


FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:%|ms\b|s\b|x\b|×|images/s|img/s|MiB\b|MB\b|KB\b"
                    r"|GB\b|GFLOP)|\b\d+\.\d+\b")
"""A measured figure: a number with a unit of time, rate, size or ratio, or a decimal."""


def figures_outside_results(text: str) -> list[str]:
    """The measured figures of a page outside its generated blocks (headings, code and inline
    code aside), each with its line: every figure a page shows must come from a results file."""
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"^#.*$", "", text, flags=re.M)
    return [f"{figure!r} in: {line.strip()}" for line in text.split("\n")
            for figure in FIGURE.findall(line)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = rendered(text)
        if new != text:
            stale.append(page)
            if not args.check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    loose = [f"{page}: {figure}" for page in PAGES
             for figure in figures_outside_results(rendered(_read(page)))]
    for line in loose:
        print(f"A figure outside the results blocks (put it in a results file): {line}",
              file=sys.stderr)
    if args.check and stale:
        print(f"Stale results tables in {', '.join(stale)}: python benchmarks/page.py",
              file=sys.stderr)
        return 1
    return 1 if loose else 0


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(main())
