"""``tfpar-env`` / ``python -m tfpar.cli.env``: what tfpar sees here, as text or ``--json``.

TensorFlow's own start-up lines (oneDNN notices, ``failed call to cuInit`` on a machine without
GPUs) are kept out of the report: they are written while TensorFlow starts, before its log
settings apply, so the report silences the process's standard error while it collects, and
prints what was written there only if collecting fails, or with ``--show_tensorflow_log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator

from absl import flags

from tfpar import env
from tfpar.cli import common

FLAGS = flags.FLAGS

flags.DEFINE_bool("json", False, "Print JSON (for tools and bug reports) instead of text.")
flags.DEFINE_bool("show_tensorflow_log", False,
                  "Also print what TensorFlow writes to standard error while it starts "
                  "(hidden by default: start-up notices, not errors of this machine).")


@contextlib.contextmanager
def _native_stderr_held(show: bool) -> Iterator[None]:
    """Holds what is written to file descriptor 2 (C++ included) while the block runs; writes
    it out afterwards if ``show`` or if the block raised."""
    if show:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))


def main(argv: list[str]) -> None:
    """Prints the environment report."""
    del argv  # run_main refuses positional arguments.
    with _native_stderr_held(FLAGS.show_tensorflow_log):
        info = env.collect()
    print(json.dumps(info, indent=2, sort_keys=True) if FLAGS.json else env.format_text(info))


def run() -> None:
    """Console-script entry point (``tfpar-env``)."""
    common.run_main(main, __name__)


if __name__ == "__main__":
    run()
