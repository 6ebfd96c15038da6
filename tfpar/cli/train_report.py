"""Human-readable reports of training runs: a one-line summary per device set, a comparison
table, and a plot of test accuracy per epoch for each device set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpar import atomic_io
from tfpar.errors import ConfigError

if TYPE_CHECKING:  # Only a type here: this module does not import TensorFlow.
    from tfpar.training.run import RunResult


def summary_line(result: RunResult) -> str:
    """Returns the summary line, e.g. ``test acc: 0.93, 13.2 sec/epoch on [CPU:0, CPU:1]``.

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


def check_plotting() -> None:
    """Raises unless matplotlib (the ``test`` or ``bench`` extra) can be imported.

    Raises:
        ConfigError: If it cannot.
    """
    try:
        import matplotlib  # noqa: F401  (only checked here)
    except ImportError:
        raise ConfigError("Plotting needs matplotlib: pip install matplotlib (in a checkout: "
                          "pip install -e \".[bench]\").") from None


def curves_figure(results: Sequence[RunResult]):
    """The plot: test accuracy and training loss per epoch, one line per device set,
    and the steady seconds per epoch of each device set with its speedup over the first.

    Args:
        results: The runs, one per device set (as ``train_each`` returns them).

    Returns:
        The matplotlib ``Figure`` (three axes: accuracy, loss, seconds per epoch).
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (accuracy, loss, seconds) = plt.subplots(1, 3, figsize=(13, 4))
    names = [f"[{', '.join(r.devices)}]" for r in results]
    for name, r in zip(names, results):
        epochs = range(r.epochs - len(r.history.get("loss", [])) + 1, r.epochs + 1)
        accuracy.plot(epochs, r.history.get("test_accuracy", []), marker="o", label=name)
        loss.plot(epochs, r.history.get("loss", []), marker="o", label=name)
    base = results[0].sec_per_epoch if results else 1.0
    bars = seconds.bar(range(len(results)), [r.sec_per_epoch for r in results],
                       color=[f"C{i}" for i in range(len(results))])
    for bar, r in zip(bars, results):
        seconds.annotate(f"{base / r.sec_per_epoch:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                             bar.get_height()),
                         ha="center", va="bottom")
    seconds.set_xticks(range(len(results)), [f"{len(r.devices)} device(s)" for r in results])
    accuracy.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy")
    loss.set(xlabel="epoch", ylabel="training loss", title="Training loss")
    seconds.set(ylabel="sec/epoch (steady epochs)", title="Time per epoch (speedup)")
    for axes in (accuracy, loss):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    first = results[0] if results else None
    if first:
        figure.suptitle(f"{first.model} on {first.dataset}, strategy {first.strategy}, batch "
                        f"{first.global_batch_size}, lr {first.lr:g}")
    figure.tight_layout()
    return figure


def write_curves(path: str, results: Sequence[RunResult]) -> None:
    """Draws :func:`curves_figure` to a PNG at ``path``, atomically (needs matplotlib)."""
    from matplotlib import pyplot as plt

    figure = curves_figure(results)
    with atomic_io.atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)
