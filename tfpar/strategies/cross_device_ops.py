"""How ``mirrored`` and ``allreduce`` reduce across the devices of one process."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tfpar.config_fields import check_choices
from tfpar.config_fields import field
from tfpar.errors import OptionValueError

if TYPE_CHECKING:
    import tensorflow as tf

    from tfpar import devices as devices_lib

CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")
"""How one process's replicas reduce (``auto``: NCCL on GPUs, reduction to one device on CPUs)."""


@dataclasses.dataclass(frozen=True)
class ReductionOptions:
    """How one process's devices reduce: the option of the ``mirrored`` and ``allreduce``
    entries, and the train command's flag of the same name.

    Attributes:
        cross_device_ops: Gradient reduction across one process's devices (auto: NCCL on
            GPUs, reduction to one device otherwise).
    """

    cross_device_ops: str = field("auto", choices=CROSS_DEVICE_OPS)

    def __post_init__(self):
        check_choices(self, OptionValueError)


def make_cross_device_ops(kind: str, devices: devices_lib.DeviceSet
                          ) -> tf.distribute.CrossDeviceOps:
    """Returns the cross-device reduction for a device set.

    Args:
        kind: One of ``CROSS_DEVICE_OPS``. ``"auto"`` picks NCCL when every device is a GPU
            (the fast path on GPUs) and otherwise reduces on one device, which is what works
            for CPUs and mixed CPU/GPU sets.
        devices: The devices being reduced over.

    Returns:
        The ``tf.distribute.CrossDeviceOps`` instance.

    Raises:
        OptionValueError: If ``kind`` is unknown, or NCCL is asked for on a set with non-GPUs.
    """
    import tensorflow as tf  # The registry's modules import no TensorFlow at import.

    if kind not in CROSS_DEVICE_OPS:
        raise OptionValueError(f"Unknown cross_device_ops {kind!r}. Allowed: "
                            f"{', '.join(CROSS_DEVICE_OPS)}.")
    if kind == "auto":
        kind = "nccl" if devices.is_gpu_only and len(devices) > 1 else "reduction_to_one_device"
    if kind in ("nccl", "hierarchical_copy") and not devices.is_gpu_only:
        raise OptionValueError(f"cross_device_ops={kind!r} needs GPUs only; {devices} has other "
                            "devices. Use 'reduction_to_one_device' or 'auto'.")
    if kind == "nccl":
        return tf.distribute.NcclAllReduce()
    if kind == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()
