"""The program output the pages quote, read by name, and checked against a run's output.

A quoted block is marked ``<!-- output: name -->`` above its fence: its first line is the command
(``$ ...``, continued with a trailing backslash), the rest the output quoted, where ``...``
stands for lines left out and ``[worker N] ...`` for a worker's lines left out. The test that runs
the command builds it from the quote (:func:`command`) and holds the run's output to it
(:func:`assert_quoted`): every other quoted line appears in the output, in the quoted order (a
line ending ``  ...`` as the start of a line: the rest of a table's row left out).
"""

import glob
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"),
         *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
MARKED = re.compile(r"<!-- output: (\w+) -->\n```\w*\n(.*?)```", re.DOTALL)
SCRIPTS = {"tfpar-launch": "launch.py", "tfpar-train": "train.py",
           "tfpar-benchmark": "benchmark.py"}


def blocks() -> dict[str, tuple[str, str]]:
    """Every marked output block, by name: ``(page, text)``."""
    found: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            for name, text in MARKED.findall(f.read()):
                assert name not in found, f"two output blocks are marked {name}"
                found[name] = (os.path.relpath(page, ROOT), text)
    return found


def _split(name: str) -> tuple[str, list[str]]:
    page, text = blocks()[name]
    lines = text.splitlines()
    assert lines and lines[0].startswith("$ "), f"{page}: block {name} starts with no command"
    command = lines[0][2:]
    rest = lines[1:]
    while command.endswith("\\"):
        command = command[:-1] + " " + rest.pop(0).strip()
    return command, rest


def command(name: str, substitutions: dict[str, str]) -> list[str]:
    """The quoted command, to run from a checkout: tfpar's programs as this Python running
    their scripts, each key of ``substitutions`` (a path) replaced by its value."""
    words = []
    for word in shlex.split(_split(name)[0]):
        for old, new in substitutions.items():
            word = word.replace(old, new)
        if word in SCRIPTS:
            words += [sys.executable, os.path.join(ROOT, "scripts", SCRIPTS[word])]
        else:
            words.append(word)
    return words


def quoted_lines(name: str, substitutions: dict[str, str]) -> list[str]:
    """The output lines quoted (not ``...`` nor a worker's elided lines), substituted."""
    lines = []
    for line in _split(name)[1]:
        if line.strip() == "..." or re.fullmatch(r"\[worker \d+\] \.\.\.", line.strip()):
            continue
        for old, new in substitutions.items():
            line = line.replace(old, new)
        lines.append(line)
    return lines


def assert_quoted(name: str, output: str, substitutions: dict[str, str]) -> None:
    """Asserts every quoted line of block ``name`` is a line of ``output``, in order."""
    actual = output.splitlines()
    position = 0
    for line in quoted_lines(name, substitutions):
        start = line[:-len("  ...")] if line.endswith("  ...") else None
        try:
            position = next(i for i in range(position, len(actual))
                            if actual[i] == line or start and actual[i].startswith(start)) + 1
        except StopIteration:
            raise AssertionError(f"block {name} of {blocks()[name][0]} quotes a line the run did "
                                 f"not print (after line {position}):\n{line}\n--- the run:\n"
                                 + "\n".join(actual[-60:])) from None
