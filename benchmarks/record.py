"""Runs a benchmark command that writes its measurements as JSON (``tfpar-benchmark``'s
``--output``) and keeps them as a results file (:mod:`results_file`): the command, date, CPU
kind, versions and kernel flags, and the command's JSON under ``measurements``.

Usage (from a checkout with tfpar installed)::

    python benchmarks/record.py benchmarks/results/KIND_DATE_CPU.json -- tfpar-benchmark ...

The command is run as given, with ``--output`` added; its exit status is this script's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_file  # noqa: E402 - beside this script.


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python benchmarks/record.py RESULTS.json -- COMMAND ...", file=sys.stderr)
        return 2
    path, command = argv[0], argv[2:]
    with tempfile.TemporaryDirectory() as scratch:
        output = os.path.join(scratch, "measurements.json")
        status = subprocess.call([*command, f"--output={output}"])
        if status:
            return status
        with open(output, encoding="utf-8") as f:
            measurements = json.load(f)
    results_file.write(path, [], command=command, measurements=measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
