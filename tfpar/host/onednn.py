"""Whether TensorFlow runs its oneDNN kernels on this CPU, chosen per CPU kind before TensorFlow
starts: TensorFlow's own rule, tfpar's choice where it differs, and the one place that sets it.

TensorFlow reads ``TF_ENABLE_ONEDNN_OPTS`` once, when it is imported (``IsMklEnabled`` in
``tensorflow/core/util/port.cc``, first called at import: the "oneDNN custom operations are on"
line); a later change has no effect. Its default, ``DefaultOneDnnPolicy``, turns oneDNN on on
Linux only for CPUs with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX; elsewhere (AVX2 CPUs such as
AMD EPYC Zen 2 and Zen 3, Intel Xeons before Cascade Lake) TensorFlow runs Eigen's kernels.
oneDNN reads ``ONEDNN_MAX_CPU_ISA``, the widest extension its kernels may use, at its first
primitive.

What tfpar does on an AVX2 CPU without those extensions, and why, is :data:`AVX2_CHOICE`.
A ``TF_ENABLE_ONEDNN_OPTS`` or ``ONEDNN_MAX_CPU_ISA`` set by the user is never changed;
``TFPAR_ONEDNN=tensorflow`` leaves TensorFlow's rule alone. tfpar's own settings, inherited from
the process that started this one (:data:`SET_BY_TFPAR_ENV` names them), are chosen again for
this CPU: taken away before TensorFlow starts where this kind's choice differs, reported with
their origin where TensorFlow started first and they are in force. Once TensorFlow started,
whether it runs oneDNN is read back from it (:func:`current`).

No TensorFlow here: this runs at ``import tfpar``, before anything imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping
from collections.abc import MutableMapping

from tfpar.compat import onednn_state
from tfpar.host.machine import cpu_flags

ENABLE_ENV = "TF_ENABLE_ONEDNN_OPTS"
"""TensorFlow's switch for its oneDNN kernels (``0``, ``1``, ``false``, ``true``)."""
CAP_ENV = "ONEDNN_MAX_CPU_ISA"
"""oneDNN's cap on the vector extension its kernels use (``AVX``, ``AVX2``, ...)."""
POLICY_ENV = "TFPAR_ONEDNN"
"""``tensorflow``: tfpar leaves TensorFlow's rule alone; unset or ``auto``: tfpar chooses."""
SET_BY_TFPAR_ENV = "TFPAR_ONEDNN_SET"
"""The settings tfpar wrote (``TF_ENABLE_ONEDNN_OPTS=1 ONEDNN_MAX_CPU_ISA=AVX``), so that the
processes that inherit them tell tfpar's choice from the user's."""

# The CPU flags (as /proc/cpuinfo names them) for which TensorFlow's DefaultOneDnnPolicy turns
# oneDNN on, on Linux.
TENSORFLOW_ONEDNN_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                           "amx_bf16")
"""CPU flags for which TensorFlow turns oneDNN on by itself (Linux, TensorFlow 2.9 and later)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """Whether oneDNN runs, and who decided.

    Attributes:
        on: Whether TensorFlow runs its oneDNN kernels.
        cap: The ``ONEDNN_MAX_CPU_ISA`` in force (``None``: none, oneDNN takes the CPU's
            widest extension).
        decided_by: ``"you"`` (the environment set it), ``"tensorflow"`` (its own rule, which
            tfpar keeps here) or ``"tfpar"`` (tfpar sets it on this CPU kind).
        reason: Why, in one sentence.
        environment: What tfpar sets before TensorFlow starts (empty when it sets nothing).
    """

    on: bool
    cap: str | None
    decided_by: str
    reason: str
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unset: tuple[str, ...] = ()
    """tfpar's own settings inherited from the process that started this one, chosen there
    for another CPU kind, which tfpar takes away before TensorFlow starts (empty: none)."""

    def describe(self) -> str:
        """One line, e.g. ``on, capped at AVX (tfpar: ...)``."""
        state = "on" if self.on else "off"
        capped = f", capped at {self.cap}" if self.on and self.cap else ""
        return f"{state}{capped} ({self.decided_by}: {self.reason})"


AVX2_CHOICE: Mapping[str, str] = {ENABLE_ENV: "1", CAP_ENV: "AVX"}
"""What tfpar sets on an x86 CPU whose widest extension is AVX2 (no AVX-512F and none of
:data:`TENSORFLOW_ONEDNN_FLAGS`): oneDNN on, capped at its AVX kernels.

TensorFlow leaves oneDNN off there, and with Eigen's kernels several logical devices of one CPU
train at about half the speed of one device. oneDNN's own AVX2 kernels are faster, but those of
the oneDNN TensorFlow 2.21 ships (3.7) corrupt the heap when they compute a convolution's
weight gradient on one thread with fewer than 8 channels (``jit:avx2`` and ``jit_1x1:avx2``
``backward_weights`` in ``ONEDNN_VERBOSE``; the 1x1 stride-2 shape is oneDNN#6035): a small
ResNet with a 4-channel stage dies with "double free or corruption" or a segmentation fault in
every run with one intra-op thread, which is what a logical device of a small machine gets.
Capped at AVX, oneDNN never dispatches those kernels (weight gradients go to its matrix
products) and the same runs train. Paired rounds on an AMD EPYC Zen 4 running these kernels
against Eigen's (the same binary code as on an AVX2 CPU) put 2 devices at 1.34x (LeNet) and
2.1x (ResNet-18) of 2 devices on Eigen, and one device at about 1.24x (ResNet-18) and 0.61x (LeNet).

bfloat16 and float16 stay on Eigen's kernels: TensorFlow hands oneDNN a bfloat16 op only on a
CPU with AVX-512F or AVX-NE-CONVERT, and a float16 op only with AVX512-FP16 or AVX-NE-CONVERT
(``IsDataTypeSupportedByOneDNNOnThisCPU``), and logs that it falls back otherwise. (On an
AVX-512 CPU capped at AVX by hand, TensorFlow does hand oneDNN bfloat16 convolutions, which then
have no kernel: :func:`bfloat16_without_kernels`.)
"""
AVX2_REASON = ("an AVX2 CPU: oneDNN's AVX kernels train faster than TensorFlow's Eigen kernels "
               "there, and its AVX2 convolutions corrupt memory on one thread with fewer than 8 "
               "channels")
"""Why, in the words :func:`choose` reports."""
POLICIES = ("auto", "tensorflow")
"""The values ``TFPAR_ONEDNN`` takes."""
_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


def _parse_bool(value: str) -> bool | None:
    """TensorFlow's reading of a boolean variable (``ReadBoolFromEnvVar``: lowercased, not
    stripped, so ``" 0"`` is no value it reads and it keeps its default)."""
    lowered = value.lower()
    return {"0": False, "false": False, "1": True, "true": True}.get(lowered)


def tensorflow_default(flags: set[str] | None) -> bool | None:
    """Whether TensorFlow turns oneDNN on by itself on a CPU with these flags (``None``:
    unknown, the flags are not readable or the CPU is not x86)."""
    if flags is None or not any(flag.startswith(("avx", "sse")) for flag in flags):
        return None
    return any(flag in flags for flag in TENSORFLOW_ONEDNN_FLAGS)


def choose(flags: set[str] | None, environ: Mapping[str, str]) -> Choice:
    """Chooses whether TensorFlow runs oneDNN on a CPU with ``flags``, given the environment.

    Args:
        flags: The CPU's flags (``/proc/cpuinfo``), ``None`` where unknown.
        environ: The process's environment (the user's settings win; tfpar's own, inherited
            from the process that started this one, are chosen again for this CPU).

    Returns:
        The choice; its ``environment`` is what to set before TensorFlow is imported, its
        ``unset`` the inherited settings of tfpar's to take away first.
    """
    choice = _choose(flags, environ)
    ours = _written_by_tfpar(environ)
    stale = tuple(sorted(name for name in ours
                         if choice.environment.get(name) != environ.get(name)))
    if not stale:
        return choice
    if not choice.environment:  # Nothing of tfpar's stays: its marker goes too.
        stale += (SET_BY_TFPAR_ENV,)
    return dataclasses.replace(choice, unset=stale)


def _choose(flags: set[str] | None, environ: Mapping[str, str]) -> Choice:
    ours = _written_by_tfpar(environ)
    cap = None if CAP_ENV in ours else environ.get(CAP_ENV) or None
    default = tensorflow_default(flags)
    if ENABLE_ENV in environ and ENABLE_ENV not in ours:
        on = _parse_bool(environ[ENABLE_ENV])
        if on is None:  # TensorFlow warns and keeps its default.
            return Choice(bool(default), cap, "tensorflow",
                          f"{ENABLE_ENV}={environ[ENABLE_ENV]!r} is not 0, 1, false or true, "
                          "so TensorFlow keeps its default")
        return Choice(on, cap, "you", f"{ENABLE_ENV}={environ[ENABLE_ENV]}")
    policy = environ.get(POLICY_ENV, "auto").strip().lower() or "auto"
    if policy not in POLICIES:
        return Choice(bool(default), cap, "tensorflow", f"{POLICY_ENV}={environ[POLICY_ENV]!r} "
                      f"is not {' or '.join(POLICIES)}, so TensorFlow's rule applies")
    if default is None or flags is None:
        return Choice(False, cap, "tensorflow", "not an x86 CPU tfpar knows, or its flags are "
                      "not readable: TensorFlow's own rule applies")
    if default:
        return Choice(True, cap, "tensorflow", "the CPU has AVX512_VNNI, AVX512_BF16, AVX_VNNI "
                      "or AMX, for which TensorFlow turns oneDNN on")
    if policy == "tensorflow":
        return Choice(False, cap, "tensorflow", f"{POLICY_ENV}=tensorflow")
    if "avx2" not in flags or "avx512f" in flags:
        return Choice(False, cap, "tensorflow", "no AVX2, or AVX-512 without VNNI or BF16: not "
                      "measured, TensorFlow's rule (off) applies")
    if cap is not None:  # The user chose the kernels: tfpar turns nothing on under them.
        return Choice(False, cap, "tensorflow", f"{CAP_ENV}={cap} is set: tfpar leaves oneDNN "
                      f"off, as TensorFlow does here ({ENABLE_ENV}=1 turns it on)")
    return Choice(True, AVX2_CHOICE[CAP_ENV], "tfpar", AVX2_REASON,
                  environment=_with_marker(AVX2_CHOICE))


def bfloat16_without_kernels(choice: Choice, flags: set[str] | None) -> bool:
    """Whether bfloat16 convolutions have no kernel under ``choice`` on a CPU with ``flags``.

    TensorFlow hands oneDNN its bfloat16 ops on a CPU with AVX-512F (or AVX-NE-CONVERT); capped
    below AVX-512, oneDNN then has no bfloat16 convolution ("could not create a primitive
    descriptor"). On a CPU without either, TensorFlow keeps bfloat16 on Eigen's kernels, so
    tfpar's own cap on AVX2 CPUs is never this case.

    Args:
        choice: The oneDNN choice in force.
        flags: The CPU's flags, ``None`` where unknown.

    Returns:
        True where a bfloat16 convolution would fail.
    """
    return bool(choice.on and choice.cap and choice.cap.upper() in _BELOW_AVX512 and flags
                and ("avx512f" in flags or "avx_ne_convert" in flags))


def _written_by_tfpar(environ: Mapping[str, str]) -> set[str]:
    """The variables of ``environ`` that hold what tfpar wrote there (inherited from the
    process that chose), not the user's."""
    written = dict(item.split("=", 1) for item in environ.get(SET_BY_TFPAR_ENV, "").split()
                   if "=" in item)
    return {name for name, value in written.items() if environ.get(name) == value}


def _with_marker(setting: Mapping[str, str]) -> dict[str, str]:
    if not setting:
        return {}
    return {**setting, SET_BY_TFPAR_ENV: " ".join(f"{k}={v}" for k, v in setting.items())}


def tensorflow_started() -> bool:
    """Whether TensorFlow was already imported in this process (too late to choose)."""
    return "tensorflow" in sys.modules


_APPLIED: dict[str, Choice] = {}


def apply(environ: MutableMapping[str, str] | None = None) -> Choice:
    """Sets tfpar's choice in the environment, if TensorFlow has not started yet.

    Called at ``import tfpar``; the environment carries the choice to every process tfpar
    starts (the launcher's workers, the benchmark's). Where TensorFlow was imported before
    tfpar, the process keeps what TensorFlow chose, and :func:`too_late` says how to start it
    where tfpar would have chosen otherwise.

    Args:
        environ: The environment to set (``os.environ`` by default).

    Returns:
        The choice in force.
    """
    environ = os.environ if environ is None else environ
    flags = cpu_flags()
    wanted = choose(flags, environ)
    if not wanted.environment and not wanted.unset:
        actual = wanted
    elif tensorflow_started():  # TensorFlow read the environment as it was.
        actual = _in_force(flags, environ, another_kind=bool(wanted.unset))
    else:
        for name in wanted.unset:
            environ.pop(name, None)
        environ.update(wanted.environment)
        actual = wanted
    _APPLIED.update(wanted=wanted, actual=actual)
    return actual


def _in_force(flags: set[str] | None, environ: Mapping[str, str],
              another_kind: bool) -> Choice:
    """What TensorFlow runs where it started before tfpar could choose: the environment as it
    was, tfpar's inherited settings included."""
    ours = _written_by_tfpar(environ)
    if ours:
        enabled = (_parse_bool(environ[ENABLE_ENV]) if ENABLE_ENV in environ else None)
        on = enabled if enabled is not None else bool(tensorflow_default(flags))
        return Choice(on, environ.get(CAP_ENV) or None, "tfpar",
                      f"inherited from the process that started this one "
                      f"({SET_BY_TFPAR_ENV}={environ[SET_BY_TFPAR_ENV]!r}: tfpar's choice for "
                      f"{'another' if another_kind else 'this'} CPU kind), in force since "
                      "TensorFlow started before tfpar was imported")
    rule = choose(flags, {**environ, POLICY_ENV: "tensorflow"})
    return dataclasses.replace(rule, reason=(
        "TensorFlow was imported before tfpar, so its own rule applies: "
        f"{'on' if rule.on else 'off'} on this CPU"))


def too_late() -> str | None:
    """One line where TensorFlow started before tfpar and runs otherwise than tfpar would have
    chosen; ``None`` where tfpar's choice is in force."""
    wanted, actual = _APPLIED.get("wanted"), _APPLIED.get("actual")
    if wanted is None or actual is None or (wanted.on, wanted.cap) == (actual.on, actual.cap):
        return None
    settings = " ".join(f"{k}={v}" for k, v in wanted.environment.items()
                        if k != SET_BY_TFPAR_ENV)
    dropped = " ".join(name for name in wanted.unset
                       if name != SET_BY_TFPAR_ENV and name not in wanted.environment)
    start = " and ".join(part for part in (f"with {settings}" if settings else "",
                                           f"without {dropped}" if dropped else "") if part)
    return (f"TensorFlow was imported before tfpar, too late for tfpar's oneDNN choice on this "
            f"CPU ({wanted.reason}): oneDNN is {actual.describe().split(' (')[0]} where tfpar "
            f"would have it {wanted.describe().split(' (')[0]}. Import tfpar before TensorFlow "
            f"(and Keras), or start Python {start}.")


_WARNED: list[bool] = []


def warn_if_too_late() -> None:
    """Warns once per process (``RuntimeWarning``) with :func:`too_late`'s line, if any."""
    line = too_late()
    if line and not _WARNED:
        _WARNED.append(True)
        warnings.warn(line, RuntimeWarning, stacklevel=3)


def current() -> Choice:
    """The choice in force in this process: what :func:`apply` found at ``import tfpar``, and
    once TensorFlow started, whether it runs oneDNN as read back from it
    (:func:`tfpar.compat.onednn_state.tensorflow_runs_onednn`, where it can be asked)."""
    choice = _APPLIED.get("actual") or choose(cpu_flags(), os.environ)
    running = onednn_state.tensorflow_runs_onednn() if tensorflow_started() else None
    if running is None or running == choice.on:
        return choice
    said, expected = ("on" if running else "off"), ("on" if choice.on else "off")
    return dataclasses.replace(
        choice, on=running, decided_by="tensorflow",
        reason=f"read back from TensorFlow, which runs it {said} where tfpar expected "
               f"{expected}: {choice.reason}")
