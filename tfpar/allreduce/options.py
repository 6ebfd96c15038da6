"""The options of tfpar's all-reduce step, and their checks (no TensorFlow at import).

The command line's flags take their choices and defaults from here, so ``--help`` and every
flag check answer before TensorFlow is imported.
"""

from __future__ import annotations

import dataclasses

from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError

ALGORITHMS = ("collective", "naive", "ring")
# PyTorch DDP's default bucket (25 MiB): large enough that per-reduction overhead vanishes,
# small enough not to double peak memory for big models.
DEFAULT_BYTES_PER_PACK = 25 * 2**20


def check_algorithm(algorithm: str) -> None:
    """Raises unless ``algorithm`` is one of :data:`ALGORITHMS`.

    Raises:
        OptionValueError: If it is not.
    """
    if algorithm not in ALGORITHMS:
        raise OptionValueError(f"Unknown all-reduce algorithm {algorithm!r}. Available: "
                            f"{', '.join(ALGORITHMS)}.")


def check_bytes_per_pack(bytes_per_pack: object, zero_means: str) -> None:
    """Raises unless ``bytes_per_pack`` is an integer >= 0 (``zero_means``: what 0 does there).

    Raises:
        ConfigError: If it is not.
    """
    if (isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int)
            or bytes_per_pack < 0):
        raise ConfigError(f"{{argument}} must be an integer >= 0 (0: {zero_means}). "
                          f"Received: {{argument}}={bytes_per_pack!r}.", argument="bytes_per_pack")


# The dtypes gradients may travel in (``StepOptions.gradient_compression``).
COMPRESSIONS = ("none", "fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the all-reduce step reduces gradients.

    Attributes:
        algorithm: All-reduce algorithm, one of :data:`ALGORITHMS`.
        bytes_per_pack: Gradient bucket size in bytes (0: one reduction per variable).
        split_weights: Per-replica shares of each batch (e.g. ``(3, 1)`` for a fast and a slow
            device); an even split when ``None``.
        gradient_compression: ``"none"``, or ``"fp16"``/``"bf16"``: the gradients travel in
            that dtype (half the bytes) and are cast back to float32 after the all-reduce.
            They are divided by the global example count first, so they are in range.
        accumulation_steps: Each replica's shard of a batch is processed as this many
            micro-batches, one after the other (activations of one at a time in memory), their
            gradients summed locally, then all-reduced once: the update is exactly one step on
            the whole batch, with one all-reduce per ``accumulation_steps`` micro-batches.
    """

    algorithm: str = "collective"
    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK
    split_weights: tuple[float, ...] | None = None
    gradient_compression: str = "none"
    accumulation_steps: int = 1

    def check(self, num_replicas: int, num_local_replicas: int) -> None:
        """Raises for options that cannot run on this many replicas.

        Raises:
            OptionValueError: For an unknown algorithm.
            ConfigError: For a bad ``bytes_per_pack`` or ``split_weights``.
        """
        check_algorithm(self.algorithm)
        if self.gradient_compression not in COMPRESSIONS:
            raise ConfigError(f"Unknown {{argument}} {self.gradient_compression!r}. "
                              f"Allowed: {', '.join(COMPRESSIONS)}.",
                              argument="gradient_compression")
        if (isinstance(self.accumulation_steps, bool)
                or not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1):
            raise ConfigError("{argument} must be an integer >= 1. Received: "
                              f"{{argument}}={self.accumulation_steps!r}.",
                              argument="accumulation_steps")
        check_bytes_per_pack(self.bytes_per_pack, "one reduction per variable")
        if self.algorithm != "collective" and num_local_replicas != num_replicas:
            raise ConfigError(f"All-reduce algorithm {self.algorithm!r} works within one "
                              "process; across workers use 'collective'.")
        if self.split_weights is None:
            return
        weights = list(self.split_weights)
        if (len(weights) != num_replicas
                or not all(isinstance(w, (int, float)) and w > 0 for w in weights)):
            raise ConfigError(f"{{argument}} needs one positive weight per replica "
                              f"({num_replicas}). Received: {{argument}}={weights}.",
                              argument="split_weights")
        if num_local_replicas != num_replicas:
            raise ConfigError("split_weights works within one process, not across workers.")
