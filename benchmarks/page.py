"""The docs' tables of benchmark results, generated from the results files in
``benchmarks/results/`` (written by the benchmarks' ``--out``), so that every figure they show
has a source.

A page holds a generated block as::

    <!-- results: saving -->
    ...the table, as this script renders it...
    <!-- /results -->

and this script fills every such block of the docs from the results files of its kind (every
file whose name starts with the kind, newest first), each table captioned with its files, CPU
kind, versions and command. ``--check`` fails (exit 1) where a page differs from what the files
render, as the docs test does.

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
    """The results files of ``kind`` (their names start with it), newest first."""
    files = []
    for path in sorted(glob.glob(os.path.join(RESULTS, f"{kind}_*.json"))):
        with open(path, encoding="utf-8") as f:
            files.append((os.path.relpath(path, ROOT), json.load(f)))
    return sorted(files, key=lambda item: item[1]["date"], reverse=True)


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


def render_saving(files: list[tuple[str, dict[str, Any]]]) -> str:
    """What saving inside an epoch costs (``benchmarks/saving.py``)."""
    lines = []
    for path, run in files:
        devices = f"{run['devices']} device{'s' if run['devices'] != 1 else ''}"
        if run.get("workers", 1) > 1:
            devices = f"{run['workers']} worker processes of {devices} each"
        chosen = run.get("default_write") == "auto"
        lines += [f"{run['model']}, global batch {run['batch']}, {run['steps']} steps an epoch "
                  f"on {devices} ({run['entry']}), {len(run['rounds'])} "
                  "rounds:", "",
                  "| saving | throughput of no saving (median, rounds) | step held per save | "
                  "a write | a kill loses at most |", "| --- | --- | --- | --- | --- |"]
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
            low, high = entry["ratio_range"]
            lines.append(f"| {_mode(mode, entry, chosen)} | {entry['throughput_ratio']:.3f} "
                         f"({low:.3f}-{high:.3f}) | "
                         f"{entry['held_seconds_per_save'] * 1000:.1f} ms | "
                         f"{entry['write_seconds'] * 1000:.0f} ms"
                         f"{' (within the step)' if within else ''} | {loses} |")
        lines += ["", _caption(path, run), ""]
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
    """A configuration's threads in words."""
    inter = configuration["inter_op_threads"] or configuration["num_devices"]
    return (f"{configuration['threads_per_device']} intra-op thread(s) per device, {inter} "
            "inter-op")


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
        lines += [f"{first['model']}, global batch {first['batch_size']}, "
                  f"`{first['strategy']}`, {rounds} rounds:", "",
                  "| devices | default: threads | images/s | `virtual_replicas`: threads | "
                  "images/s | vs default (median, rounds) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for (devices, virtual), measurement in sorted(by_key.items()):
            default = by_key.get((devices, 0))
            if not virtual or default is None:
                continue
            ratios = [v / d for v, d in zip(measurement["images_per_second"],
                                            default["images_per_second"])]
            median = statistics.median(ratios)
            lines.append(f"| {devices} | {_threads(default['configuration'])} | "
                         f"{default['median']:.0f} | "
                         f"{_threads(measurement['configuration'])} (V={virtual}) | "
                         f"{measurement['median']:.0f} | **{median:.2f}** "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) |")
        lines += ["", _caption(path, run), ""]
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[list[tuple[str, dict[str, Any]]]], str]] = {
    "saving": render_saving, "keras_distribution": render_keras_distribution,
    "world_size_invariance": render_world_size_invariance}


def rendered(text: str) -> str:
    """``text`` with every generated block rendered from the results files."""
    def block(match: re.Match) -> str:
        kind = match.group(2)
        if kind not in RENDERERS:
            raise KeyError(f"no results of kind {kind!r}: known are {', '.join(RENDERERS)}")
        return f"{match.group(1)}{RENDERERS[kind](results(kind))}<!-- /results -->"

    return BLOCK.sub(block, text)


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
    if args.check and stale:
        print(f"Stale results tables in {', '.join(stale)}: python benchmarks/page.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
