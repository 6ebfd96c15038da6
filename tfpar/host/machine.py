"""What machine this is, read without TensorFlow: the CPU's model, its widest vector
extension and oneDNN's cap on it, installed package versions. Figures differ by CPU kind, so
reports name it (``tfpar-env``, the benchmark), and tuned thread layouts are stored per kind
(:mod:`tfpar.host.thread_layouts`)."""

from __future__ import annotations

import os
import platform
from importlib import metadata

MAX_LOGICAL_CPUS = 64
"""The most logical CPU devices a process splits its CPU into: they are cheap but not free
(each has its own allocator and executor)."""


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


# oneDNN's CPU ISA levels in order (ONEDNN_MAX_CPU_ISA caps the level its kernels use), and the
# level from which each low precision runs on the CPU's own instructions: bfloat16 on AMX
# tiles or AVX512-BF16, float16 on AVX512-FP16.
_ONEDNN_LEVELS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                  "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512",
                  "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
                  "AVX10_1_512_AMX_FP16", "DEFAULT", "ALL")
_NATIVE_PRECISIONS = (("amx_bf16", "AVX512_CORE_AMX", "bfloat16 (AMX-BF16)"),
                      ("avx512_bf16", "AVX512_CORE_BF16", "bfloat16 (AVX512-BF16)"),
                      ("avx512_fp16", "AVX512_CORE_FP16", "float16 (AVX512-FP16)"))


def native_low_precisions(flags: set[str], onednn_cap: str = "unset") -> list[str]:
    """The low precisions the CPU computes natively, as oneDNN will dispatch them.

    Args:
        flags: The CPU's flags (``/proc/cpuinfo``).
        onednn_cap: ``ONEDNN_MAX_CPU_ISA`` (``"unset"``: no cap); a cap below an extension's
            level keeps oneDNN off it.

    Returns:
        E.g. ``["bfloat16 (AMX-BF16)", "bfloat16 (AVX512-BF16)", "float16 (AVX512-FP16)"]``;
        empty where every low precision is emulated (slower than float32).
    """
    cap = onednn_cap.upper()
    ceiling = (_ONEDNN_LEVELS.index(cap) if cap in _ONEDNN_LEVELS
               else len(_ONEDNN_LEVELS))  # Unset, or a name oneDNN does not know: no cap.
    return [name for flag, level, name in _NATIVE_PRECISIONS
            if flag in flags and _ONEDNN_LEVELS.index(level) <= ceiling]


def _first_cpu(cpuinfo_path: str) -> dict[str, str]:
    """The first CPU's fields in ``/proc/cpuinfo`` (they end at its first blank line); empty
    where the file cannot be read."""
    fields = {}
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's flags (``avx2``, ``avx512_bf16``, ...), ``None`` where Linux does not list
    them."""
    fields = _first_cpu(cpuinfo_path)
    return set(fields["flags"].split()) if "flags" in fields else None


def cpu(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, str]:
    """Returns the CPU's model name, its widest vector extension and oneDNN's cap on it.

    Args:
        cpuinfo_path: Where Linux describes the CPU; elsewhere the model is the platform's
            and the extension ``"unknown"``.

    Returns:
        ``model``, ``vector_extension`` (``AMX``, ``AVX-512``, ``AVX2``, ``AVX``, ``none`` or
        ``unknown``), ``onednn_max_cpu_isa`` (the ``ONEDNN_MAX_CPU_ISA`` variable, which
        caps the extension TensorFlow's oneDNN kernels use, or ``unset``),
        ``family_model`` (``"25/17"``; ``"?"`` where not reported) and ``native_bfloat16``
        (``"yes (AMX-BF16)"``, ``"no"`` or ``"unknown"``: whether Keras's
        ``mixed_bfloat16`` runs on the CPU's own instructions, which machines of one model
        may differ in), ``native_low_precisions`` (every low precision it computes natively,
        e.g. ``"bfloat16 (AMX-BF16), float16 (AVX512-FP16)"``, ``"none"`` or ``"unknown"``).
    """
    fields = _first_cpu(cpuinfo_path)
    model = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields["flags"].split()) if "flags" in fields else None
    extension = "unknown" if flags is None else next(
        (name for flag, name in _VECTOR_EXTENSIONS if flag in flags), "none")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
    native = native_low_precisions(flags or set(), cap)
    bfloat16 = [name for name in native if name.startswith("bfloat16")]
    return {"model": model, "vector_extension": extension, "onednn_max_cpu_isa": cap,
            "native_bfloat16": ("unknown" if flags is None else
                                f"yes ({bfloat16[0].split('(')[1]}" if bfloat16 else "no"),
            "native_low_precisions": ("unknown" if flags is None else
                                      ", ".join(native) or "none"),
            # Two kinds can share a model name (a VM's "Intel Xeon Processor"): the numbers
            # tell them apart.
            "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}"}


def describe_cpu() -> str:
    """Returns one line naming the CPU, e.g. ``AMD EPYC, AVX-512, 2 cores, native bfloat16:
    no``."""
    info = cpu()
    capped = ("" if info["onednn_max_cpu_isa"] == "unset"
              else f" (oneDNN capped at {info['onednn_max_cpu_isa']})")
    return (f"{info['model']}, {info['vector_extension']}{capped}, "
            f"{os.cpu_count() or 1} cores, native bfloat16: {info['native_bfloat16']}")


def describe_low_precisions() -> str:
    """One line on Keras's ``mixed_bfloat16`` here: native (and on what), or emulated."""
    info = cpu()
    if info["native_bfloat16"] == "unknown":
        return "unknown (the CPU's flags are not readable here)"
    if info["native_bfloat16"] == "no":
        return ("emulated on this CPU (no AMX-BF16 or AVX512-BF16" + (
            ", or oneDNN capped below them" if info["onednn_max_cpu_isa"] != "unset" else "")
            + "): slower than float32 here")
    return f"native on this CPU {info['native_bfloat16'][4:]}"
