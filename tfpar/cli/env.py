"""``tfpar-env`` / ``python -m tfpar.env``: what tfpar sees here, as text or ``--json``."""

from __future__ import annotations

import json

from absl import app
from absl import flags

from tfpar import env
from tfpar.cli import common

FLAGS = flags.FLAGS

flags.DEFINE_bool("json", False, "Print JSON (for tools and bug reports) instead of text.")


def main(argv: list[str]) -> None:
    """Prints the environment report."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    info = env.collect()
    print(json.dumps(info, indent=2, sort_keys=True) if FLAGS.json else env.format_text(info))


def run() -> None:
    """Console-script entry point (``tfpar-env``)."""
    common.run_main(main, __name__)


if __name__ == "__main__":
    run()
