"""The reference page of every program's flags (``docs/flags.md``), generated from the flags,
which are themselves derived from the config classes: ``python -m tfpar.cli.flag_reference >
docs/flags.md`` writes it, and a test checks that the page is what this prints.

Each program runs in a process of its own (their flags share names, which absl allows once per
process).
"""

from __future__ import annotations

import subprocess
import sys

from absl import flags

#: The programs, by script, and the modules that define their flags.
PROGRAMS = {"train": "tfpar.cli.train", "benchmark": "tfpar.cli.benchmark",
            "launch": "tfpar.cli.launch", "tfpar-env": "tfpar.cli.env"}

HEADER = """# Flags

Every flag of every program, generated from the programs (`python -m tfpar.cli.flag_reference >
docs/flags.md`; a test fails when this page and the programs differ). The flags of training and
benchmark configurations, and of the strategies' options, are derived from the config classes
(`TrainConfig`, `BenchmarkConfig`, `StepOptions`, `MultiWorkerOptions`, `ReductionOptions`):
their defaults, allowed values and descriptions live there. `--help` prints the same, grouped.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def table(module: str) -> str:
    """The Markdown table of the flags ``module`` defines (import it first)."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for flag in sorted(flags.FLAGS.get_flags_for_module(module), key=lambda f: f.name):
        default = _default(flag.default)
        rows.append(f"| `--{flag.name}` | {f'`{_cell(default)}`' if default else ''} | "
                    f"{_cell(flag.help)} |")
    return "\n".join(rows) + "\n"


def page() -> str:
    """The whole page: every program's table, each made in a process of its own."""
    parts = [HEADER]
    for script, module in PROGRAMS.items():
        listing = subprocess.run([sys.executable, "-m", "tfpar.cli.flag_reference", module],
                                 capture_output=True, text=True, check=True)
        name = f"`{script}`" if script.startswith("tfpar-") else f"`tfpar-{script}`"
        parts.append(f"## {name}\n\n{listing.stdout}")
    return "\n".join(parts)


def main(argv: list[str]) -> None:
    """Prints the page, or with a module name, that module's table."""
    if len(argv) > 1:
        __import__(argv[1])
        sys.stdout.write(table(argv[1]))
    else:
        sys.stdout.write(page())


if __name__ == "__main__":
    main(sys.argv)
