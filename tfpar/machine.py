"""What machine this is, read without TensorFlow: the CPU's model, its widest vector
extension and oneDNN's cap on it, installed package versions. Figures differ by CPU kind, so
reports name it (``tfpar-env``, the benchmark), and tuned thread layouts are stored per kind
(:mod:`tfpar.thread_layouts`)."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def package_version(package: str) -> str:
    """The installed version of ``package`` (``"not installed"`` without it), read without
    importing it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


# The widest x86 vector extension the CPU reports, widest first: the kernels TensorFlow's oneDNN
# picks at run time (Eigen's are fixed when TensorFlow is built), so two machines of the same
# name but different extensions can run the same model at different speeds.
_VECTOR_EXTENSIONS = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
                      ("avx", "AVX"))


def cpu(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, str]:
    """Returns the CPU's model name, its widest vector extension and oneDNN's cap on it.

    Args:
        cpuinfo_path: Where Linux describes the CPU; elsewhere the model is the platform's
            and the extension ``"unknown"``.

    Returns:
        ``model``, ``vector_extension`` (``AMX``, ``AVX-512``, ``AVX2``, ``AVX``, ``none`` or
        ``unknown``), ``onednn_max_cpu_isa`` (the ``ONEDNN_MAX_CPU_ISA`` variable, which
        caps the extension TensorFlow's oneDNN kernels use, or ``unset``) and
        ``family_model`` (``"25/17"``; ``"?"`` where not reported).
    """
    fields = {}
    try:
        with open(cpuinfo_path) as f:
            for line in f:  # The first CPU's fields; they end at its first blank line.
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields["flags"].split()) if "flags" in fields else None
    extension = "unknown" if flags is None else next(
        (name for flag, name in _VECTOR_EXTENSIONS if flag in flags), "none")
    return {"model": model, "vector_extension": extension,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
            # Two kinds can share a model name (a VM's "Intel Xeon Processor"): the numbers
            # tell them apart.
            "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}"}


def describe_cpu() -> str:
    """Returns one line naming the CPU, e.g. ``AMD EPYC, AVX-512, 2 cores``."""
    info = cpu()
    capped = ("" if info["onednn_max_cpu_isa"] == "unset"
              else f" (oneDNN capped at {info['onednn_max_cpu_isa']})")
    return (f"{info['model']}, {info['vector_extension']}{capped}, "
            f"{os.cpu_count() or 1} cores")
