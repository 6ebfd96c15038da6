"""World-size invariance: the same weights, bit for bit, on any number of replicas.

With ``StepOptions(virtual_replicas=V)`` every global batch is cut by position into ``V``
shards (:func:`shard_sizes`: the first ``B mod V`` shards one example longer), whatever the
number ``N`` of replicas (devices and workers) that trains it. Each shard is a replica as far
as the math goes:

- its own forward and backward pass (the gradient of the *sum* of its examples' losses), with
  its own BatchNorm batch statistics;
- its own Dropout stream: each random generator starts the shard from the step's state with
  the seed offset by the shard's index (never the device's), and every replica ends the step
  with the state one shard's draws leave;
- its own update of the variables a layer assigns in its call (BatchNorm's moving averages):
  each shard starts from the step's values, and the variables end at the step's values plus
  the mean of the shards' changes (the same on every replica, so copies never drift apart).

A replica holds ``V / N`` consecutive shards and runs them side by side (each a stateless pass
from the step's start: no shard waits for another's assignments). The shards'
gradients, changes and example counts are added in one fixed order, a binary tree over the
``V`` shards (:func:`tree_nodes`): each replica adds the largest subtrees that lie inside its
shards, the replicas all-gather those partial sums (a gather copies, it does not add), and
every replica adds the rest of the tree the same way. So one device holding all four shards of
``V=4`` and four devices holding one each add ``(s0 + s1) + (s2 + s3)`` alike; a ring
all-reduce keeps no such order for more than two members.

What the kernels compute can depend on their threads (oneDNN's convolutions split their
reductions by thread count: a gradient differs in its last bits between one intra-op thread and
two), so in this mode each device runs its kernels on one intra-op thread, and its shards on
as many inter-op threads as there are cores (tfpar's programs set these:
:func:`tfpar.host.thread_layouts.for_virtual_replicas`, given to
:func:`tfpar.devices.ensure_logical_cpus` as its ``layout``; GPUs run with TensorFlow's op
determinism). What is not invariant: the logged loss and metrics (running
sums per replica, added in another order: float32 rounding), a model's own ``train_step``, and
synchronized BatchNorm (it normalises over the global batch, not a shard: refused).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar.allreduce.options import StepOptions
from tfpar.errors import ConfigError

Node = tuple[int, int]
"""A subtree of the fixed tree: the shards ``[first, end)`` it adds."""

# Shard v's random generators run with their seed offset by (v + 1) times this (a prime).
_SEED_STRIDE = 1_000_003


def tree_nodes(first: int, end: int, virtual: int) -> list[Node]:
    """The largest subtrees of the halving tree over ``virtual`` shards that lie inside the
    shards ``[first, end)``, left to right: what a replica holding those shards adds itself.

    Args:
        first: The replica's first shard.
        end: One past its last.
        virtual: The number of shards.

    Returns:
        The subtrees, each as ``(first shard, end)``.
    """

    def inside(lo: int, hi: int) -> list[Node]:
        if end <= lo or hi <= first:
            return []
        if first <= lo and hi <= end:
            return [(lo, hi)]
        mid = (lo + hi) // 2
        return inside(lo, mid) + inside(mid, hi)

    return inside(0, virtual)


def tree_sum(known: dict[Node, Any], lo: int, hi: int) -> Any:
    """The sum of shards ``[lo, hi)`` in the tree's order, from the subtree sums ``known``."""
    if (lo, hi) in known:
        return known[(lo, hi)]
    mid = (lo + hi) // 2
    return _add(tree_sum(known, lo, mid), tree_sum(known, mid, hi))


def _add(a: Any, b: Any) -> Any:
    """``a + b``, kept as one addition by TensorFlow's graph optimizer: its arithmetic stage
    rewrites a tree of ``Add`` ops into one ``AddN``, which adds in another order (so one
    device, whose graph holds the whole tree, and four, whose graphs hold one addition each,
    added differently). A sum over an axis of two is one addition it leaves alone."""
    if not tf.is_tensor(a) and not tf.is_tensor(b):
        return a + b
    return tf.reduce_sum(tf.stack([a, b]), axis=0)


def shard_sizes(batch_size: tf.Tensor, virtual: int) -> tf.Tensor:
    """The examples of each of the ``virtual`` shards of a batch: ``B // V`` each, the first
    ``B mod V`` one more (so a replica's shards are split the same way from its own size)."""
    size = tf.cast(batch_size, tf.int32)
    return size // virtual + tf.cast(tf.range(virtual) < size % virtual, tf.int32)


def replica_slices(batch_size: tf.Tensor, virtual: int, replicas: int) -> tf.Tensor:
    """Each replica's ``[start, end)`` in a batch: its ``virtual / replicas`` consecutive
    shards. Shape ``[replicas, 2]``."""
    ends = tf.cumsum(shard_sizes(batch_size, virtual))
    bounds = tf.concat([[0], ends[virtual // replicas - 1::virtual // replicas]], 0)
    return tf.stack([bounds[:-1], bounds[1:]], axis=1)


def distribute_by_position(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset,
                           virtual: int, options: Any = None) -> Any:
    """``dataset`` (of global batches) dealt out so that replica ``r`` of every worker gets its
    shards of each batch, as :func:`replica_slices` cuts it: the same examples for a shard on
    any number of replicas and workers."""
    replicas = strategy.num_replicas_in_sync
    cut = [type(spec).__name__.removesuffix("Spec") for spec in tree.flatten(dataset.element_spec)
           if not isinstance(spec, tf.TensorSpec)]
    if cut:
        raise ConfigError(f"virtual_replicas cuts every batch into shards by position, which it "
                          f"does for dense tensors only; the data holds {', '.join(cut)}. "
                          "Make them dense (tf.sparse.to_dense, RaggedTensor.to_tensor), or "
                          "train without virtual_replicas.")

    def pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        # The replicas of this worker's pipeline, in the order the strategy deals elements.
        local = replicas // context.num_input_pipelines
        first = context.input_pipeline_id * local

        def pieces(*batch):
            element = batch[0] if len(batch) == 1 else batch
            size = tf.shape(next(t for t in tree.flatten(element) if t is not None))[0]
            bounds = replica_slices(size, virtual, replicas)
            return tf.data.Dataset.range(first, first + local).map(
                lambda r: tree.map_structure(
                    lambda t: t[bounds[r][0]:bounds[r][1]], element))

        return dataset.flat_map(pieces)

    return strategy.distribute_datasets_from_function(pipeline, options)


def start_lines(replicas: int, devices: Sequence[str]) -> list[str]:
    """What keeps this run from being bit for bit the same as one on another number of
    replicas, one line each (none: nothing does).

    Args:
        replicas: The job's replicas.
        devices: This process's devices (TensorFlow names).
    """
    lines = []
    threads = tf.config.threading.get_intra_op_parallelism_threads()
    if any("CPU" in device.upper() for device in devices) and threads != 1:
        lines.append(
            "virtual_replicas: each CPU device runs its kernels on "
            f"{f'{threads} intra-op threads' if threads else 'all cores (intra-op threads)'}, "
            "and a kernel's sums can depend on its threads; for the same "
            "weights on any number of devices start with "
            "tfpar.devices.ensure_logical_cpus(n, layout=tfpar.host.thread_layouts."
            "for_virtual_replicas(n)) (tfpar-train does).")
    if replicas & (replicas - 1):
        lines.append(
            f"virtual_replicas: {replicas} replicas is not a power of two, and Keras scales "
            f"each replica's loss by 1/{replicas}, which rounds: the weights match runs on "
            "other numbers of replicas bit for bit only where that rounding cancels (it "
            "usually does; it is certain on powers of two).")
    return lines


@dataclasses.dataclass
class _StepStart:
    """What every shard of a step starts from: the variables layers assign in their call (not
    the random generators) and the generators, with their values at the step's start."""

    assigned: list
    at_start: list
    seeds: list
    seeds_at_start: list

    @classmethod
    def of(cls, model: keras.Model, seeds: list) -> _StepStart:
        seed_ids = {id(v) for v in seeds}
        assigned = [v for v in model.non_trainable_variables if id(v) not in seed_ids]
        return cls(assigned, [tf.identity(v.value) for v in assigned], seeds,
                   [tf.identity(v.value) for v in seeds])


def train_step(model: keras.Model, options: StepOptions, data: Any,
               step: Any) -> tuple[list, tf.Tensor]:
    """This replica's shards, combined in the fixed order with every other replica's.

    Args:
        model: The model.
        options: The step's options (``virtual_replicas`` set).
        data: This replica's ``(x, y, sample_weight)``: its consecutive shards.
        step: The replica's step (``tfpar.allreduce.step``): its ``gradients(x, y,
            sample_weight, count, stateless)`` runs one shard's pass and returns the gradient
            of its part of the loss (``record`` records its loss and metrics),
            ``empty_shard()`` the zero gradients of a shard without examples, ``seeds`` are
            the model's random generators' states and ``end_seeds`` sets them where the step's
            draws leave them.

    Returns:
        The global gradients' sums (in the variables' dtypes) and the global example count
        (the assigned variables already hold the values they end the step with).
    """
    context = tf.distribute.get_replica_context()
    replicas, virtual = context.num_replicas_in_sync, options.virtual_replicas
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        raise ConfigError("virtual_replicas needs a strategy whose replica ids are known when "
                          "the step is traced (tfpar's all-reduce strategies).")
    start = _StepStart.of(model, step.seeds)
    leaves, grads = _run_shards(step, start, data, int(replica), virtual // replicas)
    total = _total_in_fixed_order(context, leaves, int(replica), replicas, virtual)
    return _step_end(total, grads, start, step, virtual)


def _run_shards(step: Any, start: _StepStart, data: Any, replica: int,
                per_replica: int) -> tuple[dict[Node, tf.Tensor], list]:
    """Runs this replica's shards side by side, each from the step's start; returns each
    shard's leaf (its gradients, the changes of the assigned variables, its generators'
    draws, whether it ran and its example count, flat) and the last shard's gradients (for
    their shapes and dtypes).

    Each shard's pass is stateless (``keras.StatelessScope``): it reads the assigned variables
    and its generators as the step starts and assigns nothing, so no shard waits for another's
    and TensorFlow runs them at once on its inter-op threads (each kernel on one thread, so
    that its sums do not depend on how many run beside it). Their losses and metrics are then
    recorded one shard after the other, in the shards' order.
    """
    first_input = next(t for t in tree.flatten(data[0]) if t is not None)
    sizes = shard_sizes(tf.shape(first_input)[0], per_replica)
    starts = tf.cumsum(sizes, exclusive=True)
    leaves: dict[Node, tf.Tensor] = {}
    at_once = side_by_side(per_replica)
    for j in range(per_replica):
        shard = replica * per_replica + j
        # At most ``at_once`` passes at a time: a shard waits for the one ``at_once`` before.
        after = [leaves[(shard - at_once, shard - at_once + 1)]] if j >= at_once else []
        with tf.name_scope(f"shard_{shard}"):
            leaves[(shard, shard + 1)], grads = _run_shard(step, start, data, shard,
                                                           sizes[j], starts[j], after)
    return leaves, grads


def side_by_side(per_replica: int) -> int:
    """How many of a replica's ``per_replica`` shards run at once: on a CPU, the inter-op
    threads each of this process's devices has (the cores it has beyond its one intra-op
    thread); a GPU runs its kernels one after the other, so one. More passes at once than
    threads would only hold more activations in memory (on two devices of two cores,
    ResNet-18's step ran at 0.84-0.89 of the default with both shards of each at once)."""
    devices = tf.distribute.get_strategy().extended.worker_devices
    if any(tf.DeviceSpec.from_string(device).device_type != "CPU" for device in devices):
        return 1
    threads = tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1
    return max(1, min(per_replica, threads // max(1, len(devices))))


def _run_shard(step: Any, start: _StepStart, data: Any, shard: int, size: tf.Tensor,
               first: tf.Tensor, after: list[tf.Tensor]) -> tuple[tf.Tensor, list]:
    """Shard ``shard`` (``size`` examples of ``data`` from ``first``), its pass run once
    ``after`` exist: its leaf and its gradients (see :func:`_run_shards`)."""
    shard_seeds = [value + tf.constant([(shard + 1) * _SEED_STRIDE, 0], value.dtype)
                   for value in start.seeds_at_start]
    stateless = [*zip(start.assigned, start.at_start), *zip(start.seeds, shard_seeds)]
    part = tree.map_structure(lambda t: None if t is None else t[first:first + size], data)
    count = tf.cast(size, tf.float32)
    # The pass's predictions (their structure) and the other variables it updated (metrics'),
    # from the pass (traced first).
    traced: list = []

    def run():
        grads, logged, y_pred, ends, updates = step.gradients(*part, count,
                                                               stateless=stateless)
        traced.append((y_pred, [variable for variable, _ in updates]))
        return grads, logged, y_pred, ends, [value for _, value in updates]

    def empty():
        # No examples: no pass, zero gradients, the state as it starts, and predictions
        # of no examples and metrics as they are (never recorded) in the pass's structure.
        y_pred = tree.map_structure(
            lambda t: tf.zeros([0, *[d or 0 for d in t.shape[1:]]], t.dtype), traced[0][0])
        return (step.empty_shard(), tf.constant(0.0), y_pred,
                [value for _, value in stateless], [v.value for v in traced[0][1]])

    with tf.control_dependencies(after):
        grads, logged, y_pred, ends, updated = tf.cond(count > 0, run, empty)

    def record():
        # What else the pass updated (metrics: Keras's per-output loss trackers, a layer's
        # own), then its loss and metrics, one shard after the other. A pass that read those
        # variables follows the record of the shard before, as without the mode.
        for variable, value in zip(traced[0][1], updated):
            variable.assign(value)
        step.record(*part, count, logged, y_pred)
        return tf.constant(0)

    tf.cond(count > 0, record, lambda: tf.constant(0))
    assigned_ends, seed_ends = ends[:len(start.assigned)], ends[len(start.assigned):]
    changes = [tf.reshape(tf.cast(end, tf.float32) - tf.cast(s, tf.float32), [-1])
               for end, s in zip(assigned_ends, start.at_start)]
    # How far the shard's draws moved each generator (0 where it did not run), and
    # whether it ran: every shard draws alike, so the step's draws are their mean.
    draws = [tf.reshape(tf.cast(end - s, tf.float32), [-1])
             for end, s in zip(seed_ends, shard_seeds)]
    leaf = tf.concat(
        [tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads] + changes + draws
        + [tf.reshape(tf.cast(count > 0, tf.float32), [1]), tf.reshape(count, [1])], 0)
    return leaf, grads


def _total_in_fixed_order(context: Any, leaves: dict[Node, tf.Tensor], replica: int,
                          replicas: int, virtual: int) -> tf.Tensor:
    """Every shard's leaf added in the fixed tree's order: this replica's subtrees, gathered
    from every replica (a gather copies, it does not add), then the rest of the tree."""
    per_replica = virtual // replicas

    def nodes_of(r: int) -> list[Node]:
        return tree_nodes(r * per_replica, (r + 1) * per_replica, virtual)

    width = max(len(nodes_of(r)) for r in range(replicas))
    own = [tree_sum(leaves, *node) for node in nodes_of(replica)]
    own += [tf.zeros_like(own[0])] * (width - len(own))
    gathered = context.all_gather(tf.stack(own), axis=0)  # [replicas * width, size]
    known = {node: gathered[r * width + k]
             for r in range(replicas) for k, node in enumerate(nodes_of(r))}
    return tree_sum(known, 0, virtual)


def _step_end(total: tf.Tensor, grads: list, start: _StepStart, step: Any,
              virtual: int) -> tuple[list, tf.Tensor]:
    """From the total: the gradients' sums, the assigned variables set to their start plus the
    shards' mean change, the generators where the step's draws leave them, and the count."""
    grad_sums, offset = [], 0
    for g in grads:
        n = int(np.prod(g.shape))
        grad_sums.append(tf.cast(tf.reshape(total[offset:offset + n], g.shape), g.dtype))
        offset += n
    for variable, value in zip(start.assigned, start.at_start):
        n = int(np.prod(value.shape))
        mean_change = tf.reshape(total[offset:offset + n], value.shape) / virtual
        offset += n
        if value.dtype.is_floating:
            end = value + tf.cast(mean_change, value.dtype)
        else:
            end = value + tf.cast(tf.round(mean_change), value.dtype)
        variable.assign(end)
    seeds_at_start = start.seeds_at_start
    seed_size = sum(int(np.prod(v.shape)) for v in seeds_at_start)
    draws_total = total[offset:offset + seed_size]
    step.end_seeds(seeds_at_start, [tf.reshape(d, v.shape) for d, v in zip(
        tf.split(draws_total, [int(np.prod(v.shape)) for v in seeds_at_start]),
        seeds_at_start)] if start.seeds else [], total[-2], 1)
    return grad_sums, total[-1]
