"""Fix: several steps per compiled call across workers.

**Several steps per compiled call across workers** (``make_train_function``,
``make_test_function``). Keras's loop for ``steps_per_execution > 1`` fails across workers
at its first call (keras-team/keras#19246; the cause is TensorFlow's, see
:mod:`tfpar.compat.collective_keys`). The fix traces the functions those methods make under
:func:`tfpar.compat.collective_keys.assigned_when_traced`, only with several workers and
``steps_per_execution > 1``.

Upstream: keras-team/keras#19246. Checked on Keras 3.15.1; the wrapped code is the same from
3.0 to 3.15. Fails without it: ``tests/compat/keras_fixes_test.py``
(``test_several_steps_per_call_fail_across_workers_without_the_fix``).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tfpar.compat import collective_keys
from tfpar.compat.keras_fixes import fix
from tfpar.compat.keras_fixes.fix import Fix


def _wrap_make_function(original: Callable, attribute: str) -> Callable:
    @functools.wraps(original)
    def make_function(self, force=False):
        made = original(self, force=force)
        function = getattr(self, attribute)
        if (function is None or getattr(function, "_tfpar_keys_when_traced", False)
                or self.steps_per_execution == 1
                or not fix.several_workers(self.distribute_strategy)
                or collective_keys.skip_reason()):
            return made

        @functools.wraps(function)
        def keys_when_traced(*args, **kwargs):
            with collective_keys.assigned_when_traced():
                return function(*args, **kwargs)

        keys_when_traced._tfpar_keys_when_traced = True  # type: ignore[attr-defined]
        setattr(self, attribute, keys_when_traced)
        return made if made is None else keys_when_traced

    return make_function


FIXES = tuple(
    Fix(f"multi_step_{kind}_function", f"several steps per compiled call of {uses} run "
        "across workers (the function's collectives keyed when traced)",
        fix.tf_trainer_class, f"make_{kind}_function",
        functools.partial(_wrap_make_function, attribute=f"{kind}_function"),
        parameters=("self", "force"))
    for kind, uses in (("train", "fit"), ("test", "evaluate and validation")))
