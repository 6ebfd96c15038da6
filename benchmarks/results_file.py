"""A benchmark run kept as a results file (``benchmarks/results/``): the command, the date, the
CPU kind and ``tfpar-env``'s view of it, the versions, the flags that change kernels, every
round, and the run's summary. The benchmarks page's tables are generated from these files
(``python -m benchmarks.page``), so every figure there has a source.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

KERNEL_FLAGS = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "TF_NUM_INTRAOP_THREADS",
                "TF_NUM_INTEROP_THREADS")
"""Environment variables that change which kernels run, recorded as set (or unset)."""


def header(launcher: str = "", command: list[str] | None = None) -> dict[str, Any]:
    """The run's provenance: command (this script's, after ``launcher``'s where a launcher ran
    it; or ``command``, where this script ran it), date, CPU kind, versions, kernel flags."""
    import keras
    import tensorflow as tf

    import tfpar
    from tfpar.host import machine
    from tfpar.host import onednn

    return {"command": " ".join(command or [*launcher.split(), "python", *sys.argv]),
            "date": datetime.date.today().isoformat(),
            "cpu": machine.describe_cpu(), "cpu_info": machine.cpu(),
            "onednn": onednn.current().describe(),
            "versions": {"tensorflow": tf.__version__, "keras": keras.version(),
                         "tfpar": tfpar.__version__},
            "flags": {name: os.environ.get(name, "unset") for name in KERNEL_FLAGS}}


def write(path: str, rounds: list[dict[str, Any]], launcher: str = "",
          command: list[str] | None = None, **summary: Any) -> None:
    """Writes the results file ``path``: the header (``launcher``: the command that launched
    this one, if any; ``command``: the command measured, where this script ran another),
    every round and the summary."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**header(launcher, command), "rounds": rounds, **summary}, f, indent=1)
        f.write("\n")
