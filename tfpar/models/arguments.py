"""Argument checks shared by the model builders."""

from __future__ import annotations


def check_builder_args(num_classes: int, input_shape: tuple[int, ...], min_size: int) -> None:
    """Raises ``ValueError`` unless the builder arguments describe a buildable model.

    Args:
        num_classes: Must be an integer >= 2.
        input_shape: Must be ``(height, width, channels)`` of positive integers, with height
            and width at least ``min_size``.
        min_size: The smallest spatial size the architecture accepts.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError("num_classes must be an integer >= 2. Received: "
                         f"num_classes={num_classes!r}.")
    shape = tuple(input_shape)
    if (len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape)
            or min(shape[:2]) < min_size):
        raise ValueError("input_shape must be (height, width, channels) of positive integers "
                         f"with height and width >= {min_size}. Received: "
                         f"input_shape={input_shape!r}.")
