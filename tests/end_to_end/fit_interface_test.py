"""A user's own models, data and callbacks under every registry entry, through plain model.fit.

Every test here is written as a user would write it: build and compile in
``strategy.scope()``, then ``fit`` / ``evaluate`` / ``predict``; the result must equal the same
code on one device.
"""

import os
import warnings

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import testing
from tfpar.compat import keras_fixes
from tfpar.compat import versions
from tfpar.errors import ConfigError
from tfpar.errors import InexactUpdateWarning

RNG = np.random.default_rng(0)
IMAGES = RNG.random((11, 6, 6, 1), dtype=np.float32)
FEATURES = RNG.random((11, 5), dtype=np.float32)
LABELS = RNG.integers(0, 3, 11).astype(np.int32)
TARGETS = RNG.random((11, 2), dtype=np.float32)
WEIGHTS = RNG.random(11, dtype=np.float32) * 2


def sequential():
    model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3, name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(3, name="logits")])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def two_inputs():
    image, features = keras.Input((6, 6, 1), name="image"), keras.Input((5,), name="features")
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(image), features])
    model = keras.Model([image, features], keras.layers.Dense(3, name="logits")(joined))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def two_outputs():
    image = keras.Input((6, 6, 1))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(
        keras.layers.Flatten()(image))
    model = keras.Model(image, {"label": keras.layers.Dense(3, name="label")(hidden),
                                "target": keras.layers.Dense(2, name="target")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "target": keras.losses.MeanSquaredError()},
                  loss_weights={"label": 1.0, "target": 0.5},
                  metrics={"target": [keras.metrics.MeanAbsoluteError()]})
    return model


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(4, activation="relu",
                                         kernel_regularizer=keras.regularizers.L2(1e-2))
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(self.flatten(x)))


def subclassed(clipnorm=None):
    model = Subclassed()
    model(IMAGES[:1])  # Creates the variables, as a user of a subclassed model does.
    model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=clipnorm),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


MODELS = {"sequential": (sequential, lambda: (IMAGES, LABELS)),
          "two_inputs": (two_inputs, lambda: ((IMAGES, FEATURES), LABELS)),
          "two_outputs": (two_outputs, lambda: (IMAGES, {"label": LABELS, "target": TARGETS})),
          "subclassed": (subclassed, lambda: (IMAGES, LABELS))}


def dataset(name: str, uneven: bool) -> tf.data.Dataset:
    # Uneven: batches of 5, 5, 1, which split 3+2, 3+2, 1+0 on 2 replicas. Even: 4, 4, 2.
    x, y = MODELS[name][1]()
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return examples.batch(5) if uneven else examples.take(10).batch(4)


class EveryEntryTest(testing.StrategyTestCase):

    def check(self, strategy_name, model_name, build=None):
        strategy = self.strategy(strategy_name, 2)
        # Keras's own step (mirrored, central_storage) averages the replicas' mean losses, so
        # only even batches give the single-device step; tfpar's all-reduce step is exact on
        # any split.
        uneven = strategy_name == "allreduce"
        build = build or MODELS[model_name][0]
        data = dataset(model_name, uneven)
        self.assertMatchesSingleDevice(build, data, strategy, rtol=1e-5, atol=1e-5)
        # evaluate and predict in parallel equal one device, after the same training. They
        # run Keras's own test step, exact on even batches.
        even = dataset(model_name, uneven=False)
        reference = build()
        with strategy.scope():
            model = build()
        model.set_weights(reference.get_weights())
        for m in (reference, model):
            m.fit(data, verbose=0)
        self.assertAllClose(reference.predict(even, verbose=0), model.predict(even, verbose=0),
                            rtol=1e-5, atol=1e-6)
        expected = reference.evaluate(even, verbose=0, return_dict=True)
        got = model.evaluate(even, verbose=0, return_dict=True)
        if versions.major_minor(keras.version()) >= (3, 16) and len(expected) > 2:
            # Keras 3.16 weights a per-output loss by the batch size when the traced batch
            # dimension is known: on one device 4, 4 and then 1 for the retraced last batch of
            # 2, under a strategy every batch by its size. Only the total loss and the metrics
            # are comparable there.
            for name in [k for k in expected if k.endswith("_loss")]:
                expected.pop(name), got.pop(name)
        self.assertAllClose(expected, got, rtol=1e-5)

    @testing.for_each_strategy(num_devices=(2,))
    def test_sequential(self, strategy_name, num_devices):
        self.check(strategy_name, "sequential")

    @testing.for_each_strategy(num_devices=(2,))
    def test_two_inputs(self, strategy_name, num_devices):
        self.check(strategy_name, "two_inputs")

    @testing.for_each_strategy(num_devices=(2,))
    def test_two_outputs_with_loss_weights(self, strategy_name, num_devices):
        self.check(strategy_name, "two_outputs")

    @testing.for_each_strategy(num_devices=(2,))
    def test_subclassed_with_regularizer(self, strategy_name, num_devices):
        # Clipping too where it is exact: Keras's step clips each replica's partial gradient
        # (tests/allreduce/step_test.py shows it).
        clip = 0.5 if strategy_name == "allreduce" else None
        self.check(strategy_name, "subclassed", lambda: subclassed(clip))


class KerasGradientAccumulationTest(testing.StrategyTestCase):
    """The optimizer's own gradient_accumulation_steps: exact on one device and under the
    all-reduce step, refused with the alternative under Keras's step with a mirrored strategy,
    where TensorFlow cannot run it."""

    REFUSED = ("mirrored", "central_storage")

    def build(self):
        model = sequential()
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    @testing.for_each_strategy(num_devices=(1, 2))
    def test_refused_under_mirrored_strategies_exact_elsewhere(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, num_devices)
        data = dataset("sequential", uneven=False)
        if strategy_name not in self.REFUSED:
            self.assertMatchesSingleDevice(self.build, data, strategy)
            return
        hint = "Train with the 'allreduce' strategy .* whose step applies it exactly"
        with strategy.scope():
            model = self.build()
        before = model.get_weights()
        with self.assertRaisesRegex(ConfigError, "The optimizer's gradient_accumulation_steps=2 "
                                                 f"fails under tf.distribute's .*{hint}"):
            model.fit(data, verbose=0)
        for expected, actual in zip(before, model.get_weights()):  # Nothing was trained.
            self.assertAllEqual(expected, actual)

    def test_tensorflow_still_fails_without_the_refusal(self):
        # Why the refusal exists (TensorFlow 2.21, Keras 3.15). If this fails, a TensorFlow or
        # Keras release runs Keras's accumulation under MirroredStrategy: gate
        # tfpar/strategies/keras_accumulation.py's refusal on the versions that cannot.
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            model = self.build()
        with self.assertRaisesRegex(RuntimeError, "merge_call"):
            model.fit(dataset("sequential", uneven=False), verbose=0)


class XlaTest(testing.StrategyTestCase):
    """A user's compile(jit_compile=True): trains on one device; on several CPU replicas,
    refused at the first step in one line (TensorFlow fails deep in the graph, and across
    workers aborts the process)."""

    def build(self):
        model = sequential()
        model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=True,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    @testing.for_each_strategy(num_devices=(1, 2))
    def test_refused_on_several_cpu_replicas(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, num_devices)
        with strategy.scope():
            model = self.build()
        before = model.get_weights()
        if num_devices == 1:
            model.fit(dataset("sequential", uneven=False), verbose=0)
            self.assertNotAllClose(before[0], model.get_weights()[0])
            return
        with self.assertRaisesRegex(ConfigError, r"^jit_compile=True cannot run on 2 replicas "
                                                 r"with CPUs among them: .* Use "
                                                 r"jit_compile=False, one device, or GPUs\.$"):
            model.fit(dataset("sequential", uneven=False), verbose=0)
        for expected, actual in zip(before, model.get_weights()):  # Nothing was trained.
            self.assertAllEqual(expected, actual)

    def test_tensorflow_still_fails_without_the_refusal(self):
        # Why the refusal exists (TensorFlow 2.21). If this fails, TensorFlow's XLA runs a
        # step across CPU devices: narrow tfpar.strategies.refusals.check_xla.
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            model = self.build()
        with self.assertRaises(tf.errors.InvalidArgumentError):
            model.fit(dataset("sequential", uneven=False), verbose=0)


class OptimizerUnderKerasStepTest(testing.StrategyTestCase):
    """What Keras's optimizer cannot apply under a mirrored strategy's Keras step: refused at
    the first step with the alternative (no weight changed), or, for clipping, said once."""

    def build(self, **optimizer_kwargs):
        def model_fn():
            model = sequential()
            model.compile(optimizer=keras.optimizers.SGD(0.1, **optimizer_kwargs),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model
        return model_fn

    def assertRefused(self, strategy_name, message, **optimizer_kwargs):
        with self.strategy(strategy_name, 2).scope():
            model = self.build(**optimizer_kwargs)()
        before = model.get_weights()
        with self.assertRaisesRegex(ConfigError, message):
            model.fit(dataset("sequential", uneven=False), verbose=0)
        for expected, actual in zip(before, model.get_weights()):
            self.assertAllEqual(expected, actual)

    @testing.for_each_strategy(num_devices=(2,), names=("mirrored", "central_storage"))
    def test_ema_overwrite_frequency_is_refused(self, strategy_name, num_devices):
        self.assertRefused(strategy_name, r"ema_overwrite_frequency=2 fails under "
                           r"tf.distribute's .* 'allreduce' strategy", use_ema=True,
                           ema_overwrite_frequency=2)

    def test_central_storage_refuses_constraints(self):
        with self.strategy("central_storage", 2).scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
                2, kernel_constraint=keras.constraints.NonNeg())])
            model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(ConfigError, r"constraints on .*kernel under "
                                                 r"'central_storage'"):
            model.fit(FEATURES, TARGETS, verbose=0)

    @testing.for_each_strategy(num_devices=(2,), names=("mirrored", "central_storage"))
    def test_weight_decay_and_ema_equal_one_device(self, strategy_name, num_devices):
        self.assertMatchesSingleDevice(self.build(weight_decay=0.05, use_ema=True),
                                       dataset("sequential", uneven=False),
                                       self.strategy(strategy_name, 2))

    def test_clipping_warns_once_on_several_replicas(self):
        for name, count, warns in (("mirrored", 2, True), ("mirrored", 1, False),
                                   ("allreduce", 2, False)):
            with self.strategy(name, count).scope():
                model = self.build(clipnorm=1.0)()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.fit(dataset("sequential", uneven=False), epochs=2, verbose=0)
            said = [w for w in caught if issubclass(w.category, InexactUpdateWarning)]
            self.assertLen(said, 1 if warns else 0, msg=f"{name} on {count}")
            if warns:
                self.assertRegex(str(said[0].message), "clipnorm=1.0 clips each replica's "
                                 "gradient before the all-reduce.*'allreduce' strategy")


class OwnSteps(keras.Model):
    """A subclassed model with its own train_step and test_step, as Keras's guides write them."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(3)
        self.flatten = keras.layers.Flatten()

    def call(self, x):
        return self.out(self.hidden(self.flatten(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self.compute_metrics(x, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.compute_loss(x=x, y=y, y_pred=y_pred)
        return self.compute_metrics(x, y, y_pred)


def own_steps():
    model = OwnSteps()
    model(IMAGES[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class OwnStepsTest(testing.StrategyTestCase):
    """A model's own train_step and test_step train, log, validate and evaluate as on one
    device under every in-process entry."""

    @testing.for_each_strategy(num_devices=(2,))
    def test_fit_validation_and_evaluate_equal_one_device(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, 2)
        data = dataset("sequential", uneven=False)
        self.assertMatchesSingleDevice(own_steps, data, strategy)
        reference = own_steps()
        with strategy.scope():
            model = own_steps()
        model.set_weights(reference.get_weights())
        histories = [m.fit(data, validation_data=data, epochs=2, verbose=0).history
                     for m in (reference, model)]
        self.assertAllClose(histories[0], histories[1], rtol=1e-5, atol=1e-6)
        self.assertAllClose(reference.evaluate(data, verbose=0, return_dict=True),
                            model.evaluate(data, verbose=0, return_dict=True), rtol=1e-5)


class GuideSteps(keras.Model):
    """The train_step and test_step of keras.io's "Customizing what happens in fit() with
    TensorFlow", as written there: compute_loss, then update_state(loss) for the metric named
    "loss"."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GuideLowerLevel(keras.Model):
    """The guide's "going lower-level" model: its own loss and loss tracker."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(self.loss_fn(y, y_pred))
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def guide_model(model_class):
    def build():
        inputs = keras.Input(shape=(13,))
        model = model_class(inputs, keras.layers.Dense(6)(inputs))
        if model_class is GuideSteps:
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        else:
            model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    return build


def guide_data() -> tf.data.Dataset:
    rng = np.random.default_rng(3)
    return tf.data.Dataset.from_tensor_slices((rng.normal(size=(24, 13)).astype("float32"),
                                               rng.normal(size=(24, 6)).astype("float32"))
                                              ).batch(4)


class GuideStepsTest(testing.StrategyTestCase, parameterized.TestCase):
    """keras.io's own train_step/test_step, copied as written, log and evaluate the loss one
    device does (Keras divides compute_loss's and a loss's value by the replica count for the
    gradient; its own steps alone multiplied it back)."""

    def fit_and_evaluate(self, build, strategy):
        reference = build()
        with strategy.scope():
            model = build()
        model.set_weights(reference.get_weights())
        return [(m.fit(guide_data(), epochs=2, verbose=0).history,
                 m.evaluate(guide_data(), verbose=0, return_dict=True))
                for m in (reference, model)]

    @testing.for_each_strategy(num_devices=(2,))
    def test_the_guides_steps_log_what_one_device_logs(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, 2)
        for model_class in (GuideSteps, GuideLowerLevel):
            (history, evaluation), (got_history, got_evaluation) = self.fit_and_evaluate(
                guide_model(model_class), strategy)
            self.assertAllClose(history, got_history, rtol=1e-5, atol=1e-6,
                                msg=model_class.__name__)
            self.assertAllClose(evaluation, got_evaluation, rtol=1e-5, atol=1e-6,
                                msg=model_class.__name__)

    def test_half_the_loss_without_the_fix(self):
        strategy = self.strategy("mirrored", 2)
        keras_fixes.uninstall(LOSS_FIXES)
        try:
            (_, evaluation), (_, got) = self.fit_and_evaluate(guide_model(GuideSteps), strategy)
        finally:
            keras_fixes.install(LOSS_FIXES)
        self.assertAllClose(got["loss"] * 2, evaluation["loss"], rtol=1e-5)


LOSS_FIXES = ("scaled_loss_records", "scaled_loss_marks", "scaled_compute_loss_marks",
              "mean_of_scaled_losses")


class AllReduceFitFeaturesTest(testing.StrategyTestCase):
    """fit's features under the all-reduce step, each equal to one device."""

    def fit_both(self, build, **fit_kwargs):
        reference = build()
        with self.strategy("allreduce", 2).scope():
            model = build()
        model.set_weights(reference.get_weights())
        histories = [m.fit(verbose=0, **fit_kwargs).history for m in (reference, model)]
        self.assertAllClose(histories[0], histories[1], rtol=1e-5, atol=1e-6)
        self.assertAllClose(reference.get_weights(), model.get_weights(), rtol=1e-5, atol=1e-6)
        return histories[1]

    def test_numpy_input_with_sample_weights(self):
        history = self.fit_both(sequential, x=IMAGES, y=LABELS, sample_weight=WEIGHTS,
                                batch_size=5, epochs=2, shuffle=False)
        self.assertLen(history["loss"], 2)

    def test_class_weight(self):
        self.fit_both(sequential, x=IMAGES, y=LABELS, class_weight={0: 1.0, 1: 3.0, 2: 0.5},
                      batch_size=5, shuffle=False)

    def test_sample_weights_in_the_dataset(self):
        data = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS, WEIGHTS)).batch(5)
        self.fit_both(sequential, x=data)

    def test_regression_metrics_are_logged(self):
        def regression():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse",
                          metrics=[keras.metrics.MeanAbsoluteError(),
                                   keras.metrics.RootMeanSquaredError()])
            return model

        history = self.fit_both(regression, x=FEATURES, y=TARGETS, batch_size=5, shuffle=False)
        self.assertGreater(history["mean_absolute_error"][0], 0.0)
        self.assertNotIn("accuracy", history)

    def test_validation_data_and_frequency(self):
        history = self.fit_both(sequential, x=IMAGES, y=LABELS, batch_size=5, epochs=2,
                                shuffle=False, validation_data=(IMAGES[:7], LABELS[:7]),
                                validation_freq=2)
        self.assertLen(history["val_loss"], 1)
        self.assertLen(history["val_accuracy"], 1)

    def test_backup_and_restore_resumes_at_the_right_epoch(self):
        backup = os.path.join(self.get_temp_dir(), "backup")
        epochs_seen = []

        class StopAfterTwo(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                epochs_seen.append(epoch)
                if epoch == 2:
                    raise KeyboardInterrupt  # A crash.

        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = sequential()
        with self.assertRaises(KeyboardInterrupt):
            model.fit(IMAGES, LABELS, batch_size=5, epochs=4, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup), StopAfterTwo()])
        with strategy.scope():
            resumed = sequential()
        epochs_seen.clear()
        record = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epochs_seen.append(epoch))
        resumed.fit(IMAGES, LABELS, batch_size=5, epochs=4, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup), record])
        self.assertEqual(epochs_seen, [2, 3])


if __name__ == "__main__":
    tf.test.main()
