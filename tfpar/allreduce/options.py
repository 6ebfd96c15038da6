"""The options of tfpar's all-reduce step, and their checks (no TensorFlow at import).

The command line's flags are derived from :class:`StepOptions` (:mod:`tfpar.cli.config_flags`),
so ``--help`` and every flag check answer before TensorFlow is imported.
"""

from __future__ import annotations

import dataclasses

from tfpar.config_fields import field
from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError

ALGORITHMS = ("collective", "naive", "ring")
"""The all-reduce algorithms of the exact step (``collective``: TensorFlow's collective ops)."""
DEFAULT_BYTES_PER_PACK = 25 * 2**20
"""PyTorch DDP's default bucket (25 MiB): large enough that per-reduction overhead vanishes, small
enough not to double peak memory for big models.
"""


def check_algorithm(algorithm: str) -> None:
    """Raises unless ``algorithm`` is one of :data:`ALGORITHMS`.

    Raises:
        OptionValueError: If it is not.
    """
    if algorithm not in ALGORITHMS:
        raise OptionValueError(f"{{argument}} must be one of {', '.join(ALGORITHMS)} (the "
                               f"all-reduce algorithm). Received: {{argument}}={algorithm!r}.",
                               argument="algorithm")


def check_bytes_per_pack(bytes_per_pack: object, zero_means: str) -> None:
    """Raises unless ``bytes_per_pack`` is an integer >= 0 (``zero_means``: what 0 does there).

    Raises:
        ConfigError: If it is not.
    """
    if (isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int)
            or bytes_per_pack < 0):
        raise ConfigError(f"{{argument}} must be an integer >= 0 (0: {zero_means}). "
                          f"Received: {{argument}}={bytes_per_pack!r}.", argument="bytes_per_pack")


COMPRESSIONS = ("none", "fp16", "bf16")
"""The dtypes gradients may travel in (``StepOptions.gradient_compression``)."""


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the all-reduce step reduces gradients: the options of the ``allreduce`` entries,
    and the train command's flags of the same names (``algorithm`` is ``--allreduce``).

    Attributes:
        algorithm: All-reduce algorithm of the hand-written step (collective: TensorFlow's
            collective ops; naive, ring: tfpar's, within one process).
        bytes_per_pack: Gradient bucket size in bytes: buckets are all-reduced from the last
            layer to the first, each as soon as it is ready, overlapping the backward pass
            (0: one reduction per variable). The 'multi_worker' entry gives it to TensorFlow's
            all-reduce (0 there: one reduction after the whole backward pass).
        split_weights: Per-device shares of each batch, e.g. 3,1 for a fast and a slow device
            (an even split if unset).
        gradient_compression: The dtype gradients travel in (fp16, bf16: half the bytes),
            cast back to float32 after the all-reduce; with fp16 they are divided by the
            global example count first, to stay in its range (bf16 has float32's range).
        accumulation_steps: Each update trains this many micro-batches of the batch size,
            one after the other, with one all-reduce: exactly one step on a batch this many
            times larger, with as many times fewer all-reduces (and the activations of one
            micro-batch at a time in memory).
        virtual_replicas: World-size invariance (0: off): every global batch is cut by
            position into this many shards, each trained as a replica of its own (its own
            forward and backward, BatchNorm batch statistics and Dropout stream), and combined
            in one fixed order, so that any number of replicas dividing it ends with the same
            weights, bit for bit.
    """

    algorithm: str = field("collective", choices=ALGORITHMS, flag="allreduce")
    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK
    split_weights: tuple[float, ...] | None = None
    gradient_compression: str = field("none", choices=COMPRESSIONS)
    accumulation_steps: int = 1
    virtual_replicas: int = 0

    def __post_init__(self):
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
        if (isinstance(self.virtual_replicas, bool)
                or not isinstance(self.virtual_replicas, int) or self.virtual_replicas < 0):
            raise ConfigError("{argument} must be an integer >= 0 (0: off). Received: "
                              f"{{argument}}={self.virtual_replicas!r}.",
                              argument="virtual_replicas")
        if self.virtual_replicas:
            others = [name for name, on in (
                ("split_weights", self.split_weights is not None),
                ("accumulation_steps", self.accumulation_steps != 1),
                ("gradient_compression", self.gradient_compression != "none")) if on]
            if others:
                raise ConfigError(f"{{argument}} fixes how each batch is cut and summed; it "
                                  f"cannot be combined with {', '.join(others)}. Received: "
                                  f"{{argument}}={self.virtual_replicas}.",
                                  argument="virtual_replicas")
        # The flag is shared with 'multi_worker', where TensorFlow reads 0 otherwise.
        check_bytes_per_pack(self.bytes_per_pack, "one reduction per variable; under "
                             "'multi_worker', one after the whole backward pass")
        if self.split_weights is not None and not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                for w in self.split_weights):
            raise ConfigError("{argument} must be positive numbers, one per replica. "
                              f"Received: {{argument}}={list(self.split_weights)}.",
                              argument="split_weights")

    def check(self, num_replicas: int, num_local_replicas: int) -> None:
        """Raises for options that cannot run on this many replicas (the rest is checked when
        the options are built).

        Raises:
            ConfigError: For an algorithm or ``split_weights`` that cannot run there.
        """
        if self.algorithm != "collective" and num_local_replicas != num_replicas:
            raise ConfigError(f"All-reduce algorithm {self.algorithm!r} works within one "
                              "process; across workers use 'collective'.")
        if self.virtual_replicas and self.virtual_replicas % num_replicas:
            divisors = [n for n in range(1, self.virtual_replicas + 1)
                        if self.virtual_replicas % n == 0]
            raise ConfigError(f"{{argument}}={self.virtual_replicas} needs a number of replicas "
                              f"that divides it ({', '.join(map(str, divisors))}); this job has "
                              f"{num_replicas}.", argument="virtual_replicas")
        if self.split_weights is None:
            return
        weights = list(self.split_weights)  # Positive: checked when the options were built.
        if len(weights) != num_replicas:
            raise ConfigError(f"{{argument}} needs one positive weight per replica "
                              f"({num_replicas}). Received: {{argument}}={weights}.",
                              argument="split_weights")
        if num_local_replicas != num_replicas:
            raise ConfigError("split_weights works within one process, not across workers.")
