"""pytest plugin (entry point ``pytest11``): logical CPU devices before any test imports TF.

``pytest --tfpar-devices=4``, or ``tfpar_devices = 4`` in the ``[pytest]`` ini section, splits
the CPU into 4 logical devices when pytest starts, before test modules are collected. Without
either, the plugin does nothing (and does not import TensorFlow).
"""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--tfpar-devices", type=int, default=None,
                     help="Split the CPU into this many logical devices before tests run.")
    parser.addini("tfpar_devices", "Default of --tfpar-devices.", default="")


def pytest_configure(config):
    count = config.getoption("--tfpar-devices") or config.getini("tfpar_devices")
    if not count:
        return
    from tfpar.testing.case import ensure_devices  # Imports TensorFlow only when asked to.

    ensure_devices(int(count))


def pytest_collection_modifyitems(config, items):
    # tf.test.TestCase inherits TensorFlow's `test_session` context manager, which pytest
    # collects and reports as a skipped "Not a test" in every test class.
    kept = [item for item in items
            if not (item.name == "test_session"
                    and getattr(getattr(item, "function", None), "__module__", "")
                    .startswith("tensorflow."))]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
