"""What this machine recommends for a training run: the precision (Keras's ``mixed_bfloat16``
where the hardware computes bfloat16 natively, float32 elsewhere) and the steps per compiled
call (what ``tfpar-benchmark --tune`` found on this machine kind), each with its reason.

The train command's ``--dtype=auto`` and ``--steps_per_execution=auto`` use it; in your own
code, :func:`recommend` returns the same as a value::

    advice = tfpar.training.recommend(devices=2)
    advice.apply_policy()                       # keras.mixed_precision.set_global_policy
    model.compile(..., **advice.compile_arguments())

On a CPU, bfloat16 is native where oneDNN can use AMX-BF16 or AVX512-BF16
(:func:`tfpar.host.machine.cpu`, read from the CPU's flags at run time, so two machines of one
model that differ in their flags get different advice); on GPUs, from compute capability 8.0
(Ampere). Elsewhere ``mixed_bfloat16`` is emulated and slower than float32, which TensorFlow's
mixed-precision guide says too, so the advice stays float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfpar.host import machine
from tfpar.host import onednn
from tfpar.host import thread_layouts

# A stored steps-per-call speedup below this is noise, not a gain (the tuning's own rule).
_MIN_GAIN = 1.02


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """A precision and steps per compiled call for a run on some devices, with the reasons.

    Attributes:
        dtype_policy: Keras's dtype policy (``"mixed_bfloat16"`` or ``"float32"``).
        steps_per_execution: Training steps per compiled call.
        reasons: One sentence per choice, for the user.
    """

    dtype_policy: str
    steps_per_execution: int
    reasons: tuple[str, ...]

    def compile_arguments(self) -> dict[str, Any]:
        """The arguments to add to ``model.compile``."""
        return {"steps_per_execution": self.steps_per_execution}

    def apply_policy(self) -> None:
        """Sets Keras's global dtype policy (build the model afterwards)."""
        import keras

        keras.mixed_precision.set_global_policy(self.dtype_policy)


def precision(device_types: set[str], gpu_capabilities: list[tuple[int, int]] | None = None,
              cpu_bfloat16: str | None = None, tuned: dict[str, Any] | None = None
              ) -> tuple[str, str]:
    """The dtype policy for devices of ``device_types`` and why.

    Args:
        device_types: ``{"CPU"}`` or ``{"GPU"}`` (a mix gets float32).
        gpu_capabilities: The GPUs' compute capabilities (read from TensorFlow if ``None``).
        cpu_bfloat16: :func:`tfpar.host.machine.cpu`'s ``native_bfloat16`` (read if ``None``).
        tuned: What ``--tune`` stored for these devices on this machine kind, if anything: a
            timing of ``mixed_bfloat16`` there decides on a CPU with native bfloat16.

    Returns:
        ``(policy, reason)``.
    """
    if device_types == {"GPU"}:
        capabilities = gpu_capabilities if gpu_capabilities is not None else _gpu_capabilities()
        if capabilities and all(c >= (8, 0) for c in capabilities):
            return "mixed_bfloat16", ("the GPUs run bfloat16 natively (compute capability "
                                      f"{min(capabilities)[0]}.{min(capabilities)[1]})")
        return "float32", ("a GPU below compute capability 8.0 would emulate bfloat16, slower "
                           "than float32")
    if device_types == {"CPU"}:
        native = cpu_bfloat16 if cpu_bfloat16 is not None else machine.cpu()["native_bfloat16"]
        timed = (tuned or {}).get("dtype", {}).get("mixed_bfloat16")
        if native.startswith("yes") and timed is not None:
            if float(timed) >= _MIN_GAIN:
                return "mixed_bfloat16", (f"this CPU runs bfloat16 natively {native[4:]}, "
                                          f"{float(timed):.2f}x float32 when tuned here")
            return "float32", (f"mixed_bfloat16 ran {float(timed):.2f}x float32 when tuned on "
                               "this machine kind")
        if native.startswith("yes"):
            return "mixed_bfloat16", f"this CPU runs bfloat16 natively {native[4:]}".rstrip()
        return "float32", ("this CPU has no native bfloat16 (no AMX-BF16 or AVX512-BF16 in "
                           "its flags, or oneDNN capped below them): mixed_bfloat16 would be "
                           "slower than float32")
    return "float32", "devices of several kinds"


def tuned_record(num_devices: int, workers: int = 1) -> dict[str, Any]:
    """What ``--tune`` stored on this machine kind for ``num_devices`` devices (or ``workers``
    worker processes on this host), or ``{}``."""
    key = thread_layouts.workers_key(workers) if workers > 1 else num_devices
    return thread_layouts.stored(key) or {}


def steps_per_call(num_devices: int, workers: int = 1) -> tuple[int, str]:
    """The steps per compiled call ``--tune`` found faster on this machine kind, and why.

    Args:
        num_devices: Devices of the process.
        workers: Worker processes on this host (a multi-worker job), or 1.
    """
    record = tuned_record(num_devices, workers)
    gains = {int(k): float(v) for k, v in record.get("steps_per_execution", {}).items()}
    best = max(gains, key=gains.__getitem__, default=None)
    if best is not None and gains[best] >= _MIN_GAIN:
        return best, (f"{best} steps per compiled call ran {gains[best]:.2f}x faster when "
                      "tuned on this machine kind")
    if record:
        return 1, "tuning on this machine kind found no gain from several steps per call"
    return 1, ("not tuned on this machine kind (tfpar-benchmark --tune times several "
               "steps per call)")


def chosen(device_types: set[str], num_devices: int, workers: int = 1, *, dtype: bool = True,
           steps_per_execution: bool = True, accuracy_note: str = ""
           ) -> tuple[dict[str, Any], str]:
    """What ``dtype="auto"`` and ``steps_per_execution="auto"`` become for these devices, and
    why, as the train command and the benchmark say it.

    Args:
        device_types: ``{"CPU"}`` or ``{"GPU"}``.
        num_devices: Devices of the process.
        workers: Worker processes of a multi-worker job on this host, or 1.
        dtype: Choose the precision.
        steps_per_execution: Choose the steps per compiled call.
        accuracy_note: Added to the precision's reason when it is not float32.

    Returns:
        The chosen fields (``dtype``, ``steps_per_execution``) and one clause per choice,
        joined by ``"; "``.
    """
    changes: dict[str, Any] = {}
    said = []
    if dtype:
        changes["dtype"], why = precision(device_types,
                                          tuned=tuned_record(num_devices, workers))
        note = accuracy_note if changes["dtype"] != "float32" else ""
        said.append(f"precision {changes['dtype']} ({why}{note})")
    if steps_per_execution:
        changes["steps_per_execution"], why = steps_per_call(num_devices, workers)
        said.append(f"{changes['steps_per_execution']} step(s) per compiled call ({why})")
    return changes, "; ".join(said)


def cpu_split_note(num_devices: int, device_types: set[str] | None = None) -> str | None:
    """One sentence where this CPU's kernels make the device count a poor choice for speed;
    ``None`` where nothing says so.

    With TensorFlow's Eigen kernels (oneDNN off), each logical device's convolutions run on
    its share of the threads at a fraction of the speed the whole pool reaches on the whole
    batch: ResNet-18 on 2 devices trains at 0.56x of one device (paired rounds, AMD EPYC
    Zen 4 with oneDNN off) and at 0.53x on an AMD EPYC Zen 3, where TensorFlow leaves oneDNN
    off. Several devices then serve testing and exactness, not speed. Where tfpar caps oneDNN
    at AVX (an AVX2 CPU, :data:`tfpar.host.onednn.AVX2_CHOICE`), several devices train faster
    than on Eigen, but one device alone may train faster on Eigen's kernels: LeNet at 1.6x,
    ResNet-18 not (0.8x; paired rounds on an AMD EPYC Zen 4 running the same kernels).
    """
    if device_types is not None and device_types != {"CPU"}:
        return None
    choice = onednn.current()
    if num_devices == 1 and choice.on and choice.decided_by == "tfpar" and choice.cap:
        return (f"on one device TensorFlow's Eigen kernels ({onednn.ENABLE_ENV}=0) may train "
                f"faster than oneDNN capped at {choice.cap}, which tfpar chooses on this CPU "
                "(LeNet-sized convolutions do, larger ones not): time both")
    if num_devices < 2 or choice.on:
        return None
    return (f"{num_devices} logical devices of one CPU train slower than one device here: "
            f"TensorFlow runs its Eigen kernels, oneDNN being off ({choice.reason}); "
            "use one device for speed, several to test or to reproduce a multi-device run")


def recommend(devices: Any = 1, *, workers: int = 1) -> Recommendation:
    """Returns the precision and steps per compiled call recommended here.

    Args:
        devices: A device set, a count or device names (as :func:`tfpar.devices.resolve`);
            resolving a count splits the CPU, so call it where you would get the strategy.
        workers: Worker processes of a multi-worker job on this host, or 1.

    Returns:
        The :class:`Recommendation`.
    """
    from tfpar import devices as devices_lib

    device_set = devices_lib.resolve(devices)
    kinds = {name.split(":")[0] for name in device_set}
    policy, why_policy = precision(kinds, tuned=tuned_record(len(device_set), workers))
    steps, why_steps = steps_per_call(len(device_set), workers)
    split = cpu_split_note(len(device_set), kinds)
    return Recommendation(policy, steps, (f"{policy}: {why_policy}",
                                          f"steps_per_execution={steps}: {why_steps}",
                                          *([f"devices: {split}"] if split else [])))


def _gpu_capabilities() -> list[tuple[int, int]]:
    import tensorflow as tf

    found = []
    for gpu in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if capability:
            found.append(tuple(capability))
    return found
