"""The threads of a multi-worker job's worker process, set before TensorFlow initialises.

In order: the CPUs a scheduler gave the worker (``OMP_NUM_THREADS``: Ray sets it to a worker's
CPUs; TensorFlow itself ignores it), else the layout ``tfpar-benchmark --tune`` stored for
this many workers on one host of this machine kind
(:func:`tfpar.host.thread_layouts.chosen_for_workers`), else TensorFlow's own threads with a
second inter-op thread for the collectives where the worker has cores to spare. Threads the
user set (``tf.config.threading``, ``TF_NUM_INTRAOP_THREADS``, ``TF_NUM_INTEROP_THREADS``)
always win, and nothing changes once TensorFlow has initialised. No TensorFlow at import.
"""

from __future__ import annotations

import os

from tfpar.host import thread_layouts

# TensorFlow's environment variables for its thread counts (read when it initialises).
_THREAD_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def set_threads(workers_on_host: int) -> str:
    """Sets this worker's threads (see the module docstring); returns where they came from.

    Args:
        workers_on_host: The job's tasks on this host, this one included.

    Returns:
        ``"budget"``, ``"tuned"``, ``"collectives"`` (a second inter-op thread) or ``"kept"``.
    """
    if _from_the_budget():
        return "budget"
    if workers_on_host > 1 and _tuned_for_the_host(workers_on_host):
        return "tuned"
    return "collectives" if _leave_a_thread_for_collectives() else "kept"


def _user_set_threads() -> bool:
    import tensorflow as tf

    return bool(any(os.environ.get(name) for name in _THREAD_ENV)
                or tf.config.threading.get_intra_op_parallelism_threads()
                or tf.config.threading.get_inter_op_parallelism_threads())


def _set(intra_op: int, inter_op: int) -> bool:
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError:
        return False  # TensorFlow has initialised: its threads are fixed.
    return True


def _from_the_budget() -> bool:
    budget = os.environ.get("OMP_NUM_THREADS", "")
    if not budget.isdigit() or int(budget) < 1 or _user_set_threads():
        return False
    # Several threads: a second inter-op thread for the collectives, as below.
    return _set(int(budget), 2 if int(budget) >= 2 else 1)


def _tuned_for_the_host(workers_on_host: int) -> bool:
    if _user_set_threads():
        return False
    layout = thread_layouts.chosen_for_workers(workers_on_host)[0]
    return layout is not None and _set(layout.threads_per_device, layout.inter_op(1))


def _leave_a_thread_for_collectives() -> bool:
    """A second inter-op thread where the worker has several compute threads.

    With one inter-op thread, TensorFlow's executor follows the backward pass's chain of ops
    inline on it, and a gradient bucket's all-reduce, ready early, waits in the pool until the
    whole backward pass is done; with two it starts at once and overlaps the backward pass.
    With one core per worker the extra thread contends with the compute instead.
    """
    import tensorflow as tf

    try:
        if (tf.config.threading.get_inter_op_parallelism_threads() == 1
                and tf.config.threading.get_intra_op_parallelism_threads() >= 2):
            tf.config.threading.set_inter_op_parallelism_threads(2)
            return True
    except RuntimeError:
        pass  # TensorFlow has initialised: its threads are fixed.
    return False
