"""What tfpar's own test modules share (pytest loads this before any of them).

- The folders of the modules tests import by name are on the import path: the worker programs
  (``tests/cluster``), the exactness matrix's models and the guides' blocks
  (``tests/end_to_end``), the Ray jobs and the skips for kernels a CPU setting leaves out
  (``tests``).
- :func:`checkpoint_values` reads a saved training state.
- Every test ends with the signal handlers it began with: a CLI ``main`` run in-process leaves
  those a real program keeps until it exits (after its error line, Ctrl-C is ignored), which
  would otherwise change how later tests in the same worker are interrupted.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in (HERE, os.path.join(HERE, "end_to_end"), os.path.join(HERE, "cluster")):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

MODEL_AND_OPTIMIZER = ("model_variables/", "optimizer/")
"""The checkpoint keys of the model's and the optimizer's variables (tfpar's EpochCheckpoint)."""


def checkpoint_values(folder: str, prefixes: tuple[str, ...] = MODEL_AND_OPTIMIZER) -> dict:
    """The tensors of the latest checkpoint in ``folder`` whose keys start with ``prefixes``."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(folder))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(prefixes)}


_HANDLED = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    before = {signum: signal.getsignal(signum) for signum in _HANDLED}
    yield
    for signum, handler in before.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


def pytest_terminal_summary(terminalreporter):
    """The explorers' counts (``record_property`` of "generated models" and "crash states"),
    one line each, from every test process."""
    lines = [f"{name}: {value}" for reports in terminalreporter.stats.values()
             for report in reports for name, value in getattr(report, "user_properties", ())
             if name in ("generated models", "crash states")]
    if lines:
        terminalreporter.section("what the explorers explored")
        for line in lines:
            terminalreporter.write_line(line)
