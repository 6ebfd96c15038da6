"""Fix: a refusal that only a step's data can reveal reaches ``fit``'s caller as one line.

**Refusals raised inside the compiled step** (``make_train_function``,
``make_test_function``, ``make_predict_function``). Some conditions tfpar
must refuse are known only when a batch arrives (a replica given no examples by a model that
cannot run on none: :data:`tfpar.allreduce.step.EMPTY_SHARD_REFUSAL`). The step asserts them
with ``tf.debugging``, and TensorFlow raises a failed assertion as
``tf.errors.InvalidArgumentError`` whose text is dozens of lines of graph nodes around the one
line. No public API of Keras or TensorFlow lets a library turn an error raised inside a
compiled function into an exception of its own: the fix wraps the function
``make_train_function`` makes, and raises an error that holds a tfpar refusal
(:func:`tfpar.errors.run_time_refusal`) as the :class:`~tfpar.errors.ConfigError` it is; any
other error passes unchanged.

Upstream: none (tfpar's own refusals). Checked on Keras 3.15.1; the wrapped code is the same
from 3.0 to 3.15. Fails without it: ``tests/compat/keras_fixes_test.py``
(``test_a_refusal_inside_the_step_is_one_line_only_with_the_fix``).
Keras 3.16: the same method (the preview 3.16.0.dev2026102704 has it unchanged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf

from tfpar import errors
from tfpar.compat.keras_fixes import fix
from tfpar.compat.keras_fixes.fix import Fix


def _wrap_make_function(original: Callable, attribute: str) -> Callable:
    @functools.wraps(original)
    def make_function(self, force=False):
        made = original(self, force=force)
        function = getattr(self, attribute)
        if function is None or getattr(function, "_tfpar_refusals_raised", False):
            return made

        @functools.wraps(function)
        def refusals_raised(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except tf.errors.InvalidArgumentError as e:
                line = errors.run_time_refusal(e.message)
                if line is None:
                    raise
                raise errors.ConfigError(line) from None

        refusals_raised._tfpar_refusals_raised = True  # type: ignore[attr-defined]
        setattr(self, attribute, refusals_raised)
        return made if made is None else refusals_raised

    return make_function


FIXES = tuple(
    Fix(name, "a refusal only a batch can reveal, asserted inside the compiled step, is "
        f"raised by {uses} as one line (a ConfigError), not as TensorFlow's error of graph "
        "nodes", fix.tf_trainer_class, f"make_{kind}_function",
        functools.partial(_wrap_make_function, attribute=f"{kind}_function"),
        parameters=("self", "force"))
    for name, kind, uses in (("run_time_refusals", "train", "fit"),
                             ("run_time_refusals_test", "test", "evaluate"),
                             ("run_time_refusals_predict", "predict", "predict")))
