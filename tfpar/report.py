"""Human-readable reports of training runs: the seeds' one-line summary and a comparison table."""

from __future__ import annotations

from typing import Sequence

from tfpar.training import RunResult


def summary_line(result: RunResult) -> str:
    """Returns the seeds' line, e.g. ``test acc: 0.93, 13.2 sec/epoch on [CPU:0, CPU:1]``.

    The images per second of the steady epochs follow in parentheses.
    """
    return (f"test acc: {result.test_accuracy:.2f}, {result.sec_per_epoch:.1f} sec/epoch on "
            f"[{', '.join(result.devices)}] ({result.images_per_second:.0f} images/s)")


def table(results: Sequence[RunResult]) -> str:
    """Returns a table of all runs with the speedup of each over the first.

    Speedup is the ratio of steady-state images per second, so runs with different batch sizes
    compare fairly.
    """
    header = ("strategy", "devices", "batch", "lr", "test acc", "sec/epoch", "images/s",
              "speedup")
    rows = [header]
    base = results[0].images_per_second if results else 1.0
    for r in results:
        rows.append((r.strategy, f"[{', '.join(r.devices)}]", str(r.global_batch_size),
                     f"{r.lr:g}", f"{r.test_accuracy:.4f}", f"{r.sec_per_epoch:.2f}",
                     f"{r.images_per_second:.0f}", f"{r.images_per_second / base:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
