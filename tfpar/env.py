"""What tfpar sees on this machine, for users and bug reports.

Run as ``tfpar-env`` or ``python -m tfpar.env`` (``--json`` for tools).

Versions (Python, tfpar, TensorFlow, Keras, the CUDA/cuDNN TensorFlow was built with), the
CPU (model, widest vector extension: oneDNN's kernels differ by it), whether TensorFlow runs
its oneDNN kernels here and who decided (:mod:`tfpar.host.onednn`), the physical devices
and the logical CPU split, the threads tfpar gives each logical CPU device,
the strategy registry with every entry's options, the cluster ``multi_worker`` would join, and
the Keras fixes tfpar installs. Nothing here initialises TensorFlow's runtime, so the CPU can
still be split afterwards.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from tfpar.compat.versions import major_minor  # noqa: F401  (tfpar.env.major_minor)
from tfpar.host import machine
from tfpar.host import onednn
from tfpar.host import thread_layouts
from tfpar.host.machine import cpu  # noqa: F401  (tfpar.env.cpu)
from tfpar.host.machine import describe_cpu
from tfpar.host.machine import package_version as _version
from tfpar.training import recommendations


def _layout(num_devices: int) -> tuple[str, str]:
    layout, source = thread_layouts.chosen(num_devices)
    return layout.describe(num_devices), source


def _worker_layout(workers: int) -> str:
    layout, source = thread_layouts.chosen_for_workers(workers)
    return f"{layout.describe(1)} ({source})" if layout is not None else source


def _cluster() -> dict[str, Any]:
    from tfpar.cluster import spec as cluster_spec
    from tfpar.errors import TfparError

    if os.environ.get("TF_CONFIG"):
        try:
            spec, task_type, task_index = cluster_spec.parse_tf_config(os.environ["TF_CONFIG"])
        except TfparError as e:
            return {"source": "TF_CONFIG", "error": str(e)}
        return {"source": "TF_CONFIG", "cluster": spec, "task": f"{task_type}:{task_index}"}
    if os.environ.get("SLURM_JOB_ID"):
        return {"source": "SLURM", "job": os.environ["SLURM_JOB_ID"],
                "tasks": os.environ.get("SLURM_NTASKS", "?")}
    return {"source": "none", "note": "multi_worker would run as a single worker"}


def collect() -> dict[str, Any]:
    """Returns everything :mod:`tfpar.env` reports, as JSON-serialisable data."""
    import tensorflow as tf

    import tfpar
    from tfpar import devices
    from tfpar import strategies
    from tfpar.compat import iterator_release
    from tfpar.compat import keras_fixes

    build = dict(tf.sysconfig.get_build_info())
    cores = os.cpu_count() or 1
    return {
        "versions": {
            "python": platform.python_version(), "tfpar": tfpar.__version__,
            "tensorflow": tf.__version__, "keras": _version("keras"),
            "tensorboard": _version("tensorboard"),
            "cuda (build)": build.get("cuda_version", "none (CPU build)"),
            "cudnn (build)": build.get("cudnn_version", "none (CPU build)"),
            "nccl": ("in this CUDA build (used on GPUs)" if build.get("is_cuda_build")
                     else "not available (CPU build)"),
        },
        "machine": {"platform": platform.platform(), "cpu_cores": cores,
                    "cpu": describe_cpu(),
                    "onednn": onednn.current().describe(),
                    "logical_devices": (recommendations.cpu_split_note(2) or
                                        "several logical devices of the CPU may train faster "
                                        "than one: tfpar-benchmark measures it"),
                    "native_low_precisions": machine.cpu()["native_low_precisions"],
                    "mixed_bfloat16": _mixed_bfloat16()},
        "devices": {
            "physical": [d.name for d in tf.config.list_physical_devices()],
            "logical_cpus": devices.logical_cpu_count(),
            "gpus": devices.gpu_count(),
        },
        "threads": {
            "layout_per_device_count": {
                str(n): "{} ({})".format(*_layout(n)) for n in (2, 4) if n <= max(2, cores)},
            "layout_of_2_workers_on_one_host": _worker_layout(2),
            "tuning_file": thread_layouts.tuning_file(),
            "per_device_pools_env": os.environ.get(thread_layouts.PER_DEVICE_THREAD_POOLS_ENV,
                                                   "unset (tfpar sets it when it splits the CPU)"),
        },
        "strategies": {name: {"description": strategies.entry(name).description,
                              "options": {k: repr(v) for k, v in
                                          strategies.entry(name).options().items()}}
                       for name in strategies.available()},
        "cluster": _cluster(),
        "saving": _saving(devices.gpu_count()),
        "keras_fixes": keras_fixes.status(),
        "iterator_release": iterator_release.status(),
    }


def _saving(gpus: int) -> dict[str, str]:
    """How training state is saved on this machine (``EpochCheckpoint``, ``--model_dir``)."""
    from tfpar.callbacks import save_interval

    budget = save_interval.percent(save_interval.BUDGET)
    return {"write": ("in the background: the step waits only for a copy of the state in "
                      "host memory" if gpus else
                      "the cheaper of in the background and within the step, timed on each "
                      "run, as a write in the background takes the CPU cores the step runs on")
            + " (write_in_background: True, False or 'auto')",
            "automatic_interval": (
                f"the most frequent whose saves cost at most {budget} of the training time "
                "(save_budget), counting "
                + ("only the time a save holds the step, as its write runs beside the GPUs' "
                   "steps" if gpus else "each write's time too, as it runs on the CPU cores "
                   "the step runs on"))}


def _mixed_bfloat16() -> str:
    """Whether Keras's ``mixed_bfloat16`` runs natively here: on the CPU (its flags and
    oneDNN's cap), and on each GPU from compute capability 8.0 (bfloat16 tensor cores)."""
    import tensorflow as tf

    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if capability:
            gpus.append(f"{gpu.name}: compute capability {capability[0]}.{capability[1]}, "
                        + ("native" if tuple(capability) >= (8, 0) else "emulated (below 8.0)"))
    return "; ".join([machine.describe_low_precisions(), *gpus])


def format_text(info: dict[str, Any]) -> str:
    """Returns :func:`collect`'s data as indented plain text."""
    lines = []

    def add(value: Any, indent: int) -> None:
        for key, item in value.items():
            if isinstance(item, dict) and item:
                lines.append(f"{' ' * indent}{key}:")
                add(item, indent + 2)
            else:
                lines.append(f"{' ' * indent}{key}: {item if item != {} else 'none'}")

    add(info, 0)
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.exit("Error: this is the library tfpar-env reports with; run tfpar-env (or python -m "
             "tfpar.cli.env) instead.")
