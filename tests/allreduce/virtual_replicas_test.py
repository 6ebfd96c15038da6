"""Tests of world-size invariance (``virtual_replicas``): the fixed tree, the cut by position,
bit-for-bit equality on 1, 2 and 4 devices, and what the mode refuses."""

from unittest import mock

import keras
import numpy as np
import step_test
import tensorflow as tf

import tfpar
from tfpar import testing
from tfpar.allreduce import step as step_lib
from tfpar.allreduce import virtual_replicas
from tfpar.allreduce.options import StepOptions
from tfpar.errors import ConfigError
from tfpar.models import resnet as resnet_lib
from tfpar.testing import generated_models

IMAGE = (18, 18, 1)


def small_resnet() -> keras.Model:
    """BatchNorm after every convolution, and Dropout before the classifier."""
    inputs = keras.Input(IMAGE)
    features = resnet_lib.resnet((4, 8), (1, 1), num_classes=8, input_shape=IMAGE)(inputs)
    outputs = keras.layers.Dense(3)(keras.layers.Dropout(0.25, seed=3)(features))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def lenet() -> keras.Model:
    model = tfpar.models.lenet(num_classes=3, input_shape=IMAGE)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def users_functional() -> keras.Model:
    """A user's functional model: BatchNorm, Dropout, Adam with EMA."""
    inputs = keras.Input(IMAGE)
    x = keras.layers.Conv2D(4, 3)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    x = keras.layers.ReLU()(keras.layers.Flatten()(x))
    x = keras.layers.Dropout(0.3, seed=7)(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    outputs = keras.layers.Dense(3)(keras.layers.BatchNormalization(momentum=0.8)(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def steps_traced_with_each_replicas_shapes(model: keras.Model, data: tf.data.Dataset,
                                           strategy: tf.distribute.Strategy) -> list:
    """Trains one pass as Keras 3.16's ``fit`` does with ``steps_per_execution=1``: the step
    traced with each replica's batches' static shapes, relaxed only where they change (a
    replica dealt one example of every batch keeps a static batch of 1)."""
    distributed = strategy.experimental_distribute_dataset(data)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def step(batch):
        return strategy.run(model.train_step, args=(batch,))

    for batch in distributed:
        step(batch)
    return []


def dataset(examples: int = 48, batch: int = 16) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.random((examples, *IMAGE), dtype=np.float32)
    y = rng.integers(0, 3, examples)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def ancestors(op: tf.Operation) -> set[str]:
    """The names of the operations ``op`` waits for (its inputs' and control inputs')."""
    seen: set[str] = set()
    todo = [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


class TreeTest(tf.test.TestCase):

    def test_each_replica_adds_the_largest_subtrees_of_its_shards(self):
        self.assertEqual(virtual_replicas.tree_nodes(0, 4, 4), [(0, 4)])
        self.assertEqual(virtual_replicas.tree_nodes(2, 4, 4), [(2, 4)])
        self.assertEqual(virtual_replicas.tree_nodes(1, 2, 4), [(1, 2)])
        # Six shards on three replicas: a pair that straddles the tree's halves.
        self.assertEqual(virtual_replicas.tree_nodes(2, 4, 6), [(2, 3), (3, 4)])
        self.assertEqual(virtual_replicas.tree_nodes(4, 6, 6), [(4, 6)])

    def test_the_sum_takes_the_trees_order_whoever_holds_the_shards(self):
        # float32 values whose sum depends on the order: (a + b) + (c + d) only.
        a, b, c, d = (np.float32(v) for v in (1e8, 1.0, -1e8, 1.0))
        leaves = {(0, 1): a, (1, 2): b, (2, 3): c, (3, 4): d}
        one = virtual_replicas.tree_sum(leaves, 0, 4)
        halves = {(0, 2): virtual_replicas.tree_sum(leaves, 0, 2),
                  (2, 4): virtual_replicas.tree_sum(leaves, 2, 4)}
        self.assertEqual(one, virtual_replicas.tree_sum(halves, 0, 4))
        self.assertEqual(one, (a + b) + (c + d))
        self.assertNotEqual(one, ((a + b) + c) + d)

    def test_a_batch_is_cut_by_position_the_same_for_any_number_of_replicas(self):
        sizes = virtual_replicas.shard_sizes(tf.constant(10), 4).numpy()
        self.assertAllEqual(sizes, [3, 3, 2, 2])
        self.assertAllEqual(virtual_replicas.replica_slices(tf.constant(10), 4, 2).numpy(),
                            [[0, 6], [6, 10]])
        self.assertAllEqual(virtual_replicas.replica_slices(tf.constant(10), 4, 4).numpy(),
                            [[0, 3], [3, 6], [6, 8], [8, 10]])
        # A replica's own shards, cut from its size, are the batch's.
        self.assertAllEqual(virtual_replicas.shard_sizes(tf.constant(6), 2).numpy(), [3, 3])
        self.assertAllEqual(virtual_replicas.shard_sizes(tf.constant(4), 2).numpy(), [2, 2])


class WorldSizeInvarianceTest(testing.StrategyTestCase):
    NUM_DEVICES = 4

    def test_lenet(self):
        self.assertSameOnAnyWorldSize(lenet, dataset())

    def test_a_small_resnet_with_batchnorm_and_dropout(self):
        self.assertSameOnAnyWorldSize(small_resnet, dataset())

    def test_a_users_functional_model_with_adam_ema(self):
        self.assertSameOnAnyWorldSize(users_functional, dataset())

    def test_a_last_batch_smaller_than_the_shards(self):
        # 42 examples at 16: a last batch of 10 (shards of 3, 3, 2, 2), and of 2 with 34.
        self.assertSameOnAnyWorldSize(users_functional, dataset(42))
        self.assertSameOnAnyWorldSize(lenet, dataset(34))

    def test_without_the_mode_the_world_size_shows(self):
        # The same check fails for the default step (virtual_replicas=0): it is not vacuous.
        with self.assertRaisesRegex(AssertionError, "differ from 1 device"):
            self.assertSameOnAnyWorldSize(
                users_functional, dataset(), virtual_replicas=0, num_devices=(1, 2))


class UsersModelsTest(testing.StrategyTestCase):
    """Models and losses users train, each the same on any number of devices."""

    NUM_DEVICES = 4

    def test_dropout_with_a_batch_smaller_than_the_shards(self):
        # 18 at 8: a last batch of 2, so shards 2 and 3 are empty (and on 4 devices so are
        # replicas 2 and 3); their generators still end where the others' do.
        self.assertSameOnAnyWorldSize(step_test.dropout_model, step_test.vectors(18, 8))

    def test_dropout_on_data_of_unknown_length(self):
        # Keras 3.15 calls the step once more at the end of such data, which ends without a
        # batch: the shards' generators must not move (the first shard's did, by its offset,
        # on every replica its own).
        known = step_test.vectors(18, 8)
        unknown = tf.data.Dataset.from_generator(
            lambda: iter(known), output_signature=known.element_spec)
        self.assertSameOnAnyWorldSize(step_test.dropout_model, unknown)

    def test_a_sum_loss(self):
        self.assertSameOnAnyWorldSize(step_test.dense_model("sum"), step_test.vectors(19, 8))

    def test_a_sum_loss_equals_one_device_without_the_mode(self):
        self.assertMatchesSingleDevice(step_test.dense_model("sum"), step_test.vectors(19, 8),
                                       self.strategy("allreduce", 1, virtual_replicas=4))

    def test_an_embedding(self):
        self.assertSameOnAnyWorldSize(step_test.embedding_model,
                                      step_test.vectors(18, 8, tokens=True))

    def test_a_replica_whose_batch_size_the_trace_knows(self):
        # 13 at 5 on 4 devices: replicas 1 and 2 get one example of every batch, so a trace
        # with static shapes knows their batch size; constant folding then turned the mean's
        # gradient (a division by 5) into a multiplication by 0.2 there alone: other bits.
        case = generated_models.ModelCase(
            inputs="tokens", layers=("dense",), loss="custom", weights="sample",
            dtype="mixed_bfloat16", examples=13, batch_size=5, seed=2)
        self.addCleanup(keras.config.set_dtype_policy, "float32")
        self.assertSameOnAnyWorldSize(case.build, case.dataset(), num_devices=(1, 4),
                                      seed=case.seed,
                                      train=steps_traced_with_each_replicas_shapes)

    def test_sequences_padded_per_batch_to_their_own_length(self):
        # Lengths 5, 5, 6, 5 at batches of 8, 7, 8, 6: on one device the last batch reuses the
        # trace whose length is 5, on 4 its shards (2, 2, 1, 1) trace anew with the length
        # unknown; the step traces the length the dataset declares (unknown) on both.
        rng = np.random.default_rng(0)
        batches = [(rng.integers(1, 12, (size, length)).astype("int32"),
                    rng.integers(0, 3, size).astype("int32"))
                   for size, length in ((8, 5), (7, 5), (8, 6), (6, 5))]
        sequences = tf.data.Dataset.from_generator(
            lambda: iter(batches), output_signature=(tf.TensorSpec([None, None], tf.int32),
                                                     tf.TensorSpec([None], tf.int32)))

        def attention() -> keras.Model:
            inputs = keras.Input((None,), dtype="int32")
            embedded = keras.layers.Embedding(12, 8)(inputs)
            attended = keras.layers.MultiHeadAttention(2, 4)(embedded, embedded)
            pooled = keras.layers.GlobalAveragePooling1D()(
                keras.layers.LayerNormalization()(attended + embedded))
            model = keras.Model(inputs, keras.layers.Dense(3)(pooled))
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model

        self.assertSameOnAnyWorldSize(attention, sequences, num_devices=(1, 4),
                                      train=steps_traced_with_each_replicas_shapes)

    def test_bfloat16(self):
        keras.config.set_dtype_policy("bfloat16")
        self.addCleanup(keras.config.set_dtype_policy, "float32")
        self.assertSameOnAnyWorldSize(step_test.dense_model(), step_test.vectors(18, 8))


class RefusalsTest(testing.StrategyTestCase):
    NUM_DEVICES = 4

    def test_a_number_of_replicas_that_does_not_divide_it(self):
        with self.assertRaisesRegex(ConfigError, r"virtual_replicas=4 needs a number of replicas "
                                                 r"that divides it \(1, 2, 4\); this job has 3"):
            tfpar.strategies.get("allreduce", devices=3, virtual_replicas=4)

    def test_options_that_change_the_cut_or_the_sum(self):
        for options in ({"accumulation_steps": 2}, {"gradient_compression": "bf16"},
                        {"split_weights": (1.0, 1.0)}):
            with self.subTest(**options), self.assertRaisesRegex(
                    ConfigError, "cannot be combined with"):
                tfpar.strategies.get("allreduce", devices=2, virtual_replicas=4, **options)
        with self.assertRaisesRegex(ConfigError, "must be an integer >= 0"):
            tfpar.strategies.get("allreduce", devices=2, virtual_replicas=-1)

    def test_sparse_or_ragged_data(self):
        rng = np.random.default_rng(0)
        sparse = tf.sparse.from_dense((rng.random((13, 10)) > 0.7).astype("float32"))
        data = tf.data.Dataset.from_tensor_slices((sparse, np.zeros(13, "int32"))).batch(5)

        def model_fn() -> keras.Model:
            inputs = keras.Input((10,), sparse=True)
            model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
            model.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model

        with self.assertRaisesRegex(ConfigError, r"^virtual_replicas cuts every batch into "
                                                 r"shards by position, which it does for dense "
                                                 r"tensors only; the data holds SparseTensor\. "
                                                 r"Make them dense [^\n]*$"):
            self.assertSameOnAnyWorldSize(model_fn, data, num_devices=(1, 2))

    def test_synchronized_batchnorm(self):
        strategy = tfpar.strategies.get("allreduce", devices=2, virtual_replicas=2)
        with strategy.scope():
            model = keras.Sequential([keras.Input(IMAGE), keras.layers.Flatten(),
                                      keras.layers.BatchNormalization(synchronized=True),
                                      keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with self.assertRaisesRegex(ConfigError, "synchronized BatchNorm normalises over"):
            model.fit(dataset(), epochs=1, verbose=0)

    def test_a_models_own_train_step(self):
        strategy = tfpar.strategies.get("allreduce", devices=2, virtual_replicas=2)
        with strategy.scope():
            inputs = keras.Input(IMAGE)
            model = step_test.OwnStepModel(inputs, keras.layers.Dense(3)(
                keras.layers.Flatten()(inputs)))
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with self.assertRaisesRegex(ConfigError, r"virtual_replicas=2 cannot train a model with "
                                                 r"its own train_step \(OwnStepModel"):
            model.fit(dataset(), epochs=1, verbose=0)

    def test_a_layer_that_assigns_a_trainable_variable_in_its_call(self):
        # A stateless pass would lose the assignment: refused in one line, not lost.
        class AssignsTrainable(keras.layers.Layer):
            def build(self, shape):
                self.k = self.add_weight(shape=(shape[-1],), initializer="zeros")

            def call(self, x):
                self.k.assign(self.k + 1.0)
                return x + 0.0 * self.k

        strategy = tfpar.strategies.get("allreduce", devices=2, virtual_replicas=2)
        with strategy.scope():
            model = keras.Sequential([keras.Input(IMAGE), keras.layers.Flatten(),
                                      AssignsTrainable(), keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with self.assertRaisesRegex(ConfigError, r"^virtual_replicas runs a replica's shards "
                                                 r"side by side, each from the step's start; "
                                                 r"the model assigns the trainable variable\(s\) "
                                                 r"[^,\n]*assigns_trainable/variable in its "
                                                 r"call, which would be lost\. Assign only "
                                                 r"non-trainable variables \(or update "
                                                 r"metrics\) in call\(\)\.$"):
            model.fit(dataset(), epochs=1, verbose=0)

    def test_several_losses_and_metrics_inside_a_layer_and_a_nested_model(self):
        # Keras updates a model's per-output loss trackers inside compute_loss, and a layer
        # may update a metric of its own in its call: recorded shard after shard.
        class CountsCalls(keras.layers.Layer):
            def __init__(self):
                super().__init__()
                self.calls = keras.metrics.Sum()

            def call(self, x):
                self.calls.update_state(1.0)
                return x

        class Nested(keras.Model):  # Keras lists no nested model's metrics of its own.
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(6)
                self.tracker = keras.metrics.Mean()

            def call(self, x):
                hidden = self.dense(x)
                self.tracker.update_state(keras.ops.mean(hidden))
                return hidden

        def model_fn():
            inputs = keras.Input((8,))
            hidden = CountsCalls()(Nested()(inputs))
            model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(hidden),
                                         "b": keras.layers.Dense(2, name="b")(hidden)})
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss={"a": "mse", "b": "mse"}, loss_weights={"a": 1.0, "b": 0.5},
                          metrics={"a": ["mae"]})
            return model

        rng = np.random.default_rng(1)
        data = tf.data.Dataset.from_tensor_slices(
            (rng.random((40, 8), dtype=np.float32),
             {"a": rng.random((40, 1), dtype=np.float32),
              "b": rng.random((40, 2), dtype=np.float32)})).batch(8)
        self.assertSameOnAnyWorldSize(model_fn, data)

    def test_a_value_a_layer_assigns_then_reads_has_no_gradient(self):
        # As a variable's read: the Dense before it gets no gradient through the value.
        class AssignsThenReads(keras.layers.Layer):
            def build(self, shape):
                self.w = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                         trainable=False)

            def call(self, x):
                self.w.assign(keras.ops.mean(x, 0))
                return 0.0 * x + self.w

        strategy = tfpar.strategies.get("allreduce", devices=1, virtual_replicas=2)
        with strategy.scope():
            first = keras.layers.Dense(4)
            model = keras.Sequential([keras.Input((8,)), first, AssignsThenReads(),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        before = first.kernel.numpy()
        model.fit(np.ones((8, 8), np.float32), np.ones((8, 1), np.float32), batch_size=8,
                  verbose=0)
        self.assertAllEqual(first.kernel.numpy(), before)

    def test_the_shards_of_a_device_run_side_by_side_on_the_layouts_threads(self):
        from tfpar.host import thread_layouts
        self.assertEqual(thread_layouts.for_virtual_replicas(1, cores=2),
                         thread_layouts.ThreadLayout(1, inter_op_threads=2))
        self.assertEqual(thread_layouts.for_virtual_replicas(4, cores=2),
                         thread_layouts.ThreadLayout(1, inter_op_threads=4))
        # In the step's graph no shard's pass depends on another's (BatchNorm and Dropout
        # read state each would otherwise assign) where the device has the threads to run them
        # at once; their records of the loss and metrics follow one another.
        strategy = tfpar.strategies.get("allreduce", devices=1, virtual_replicas=2)
        with strategy.scope():
            model = small_resnet()
            model.optimizer.build(model.trainable_variables)
        data = (tf.zeros((8, *IMAGE)), tf.zeros((8,), tf.int64), None)

        def after(threads: int) -> dict[str, bool]:
            @tf.function
            def step():
                return strategy.run(lambda: step_lib.train_step(
                    model, StepOptions(virtual_replicas=2), data))

            with mock.patch.object(tf.config.threading, "get_inter_op_parallelism_threads",
                                   return_value=threads):
                graph = step.get_concrete_function().graph
            ops = {op.name: op for op in graph.get_operations()}
            return {name: f"shard_0/{name}" in ancestors(ops[f"shard_1/{name}"])
                    for name in ("cond", "cond_1")}  # The pass, then the record.

        self.assertEqual(after(threads=2), {"cond": False, "cond_1": True})
        self.assertEqual(after(threads=1), {"cond": True, "cond_1": True})

if __name__ == "__main__":
    tf.test.main()
