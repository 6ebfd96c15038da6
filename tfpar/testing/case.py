"""``StrategyTestCase``, the per-strategy parameterisation and the device set-up for tests."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import devices
from tfpar import strategies
from tfpar.errors import DeviceError
from tfpar.errors import RegistryError
from tfpar.errors import TfparError
from tfpar.strategies.registry import StrategyChoice
from tfpar.testing import generated_models
from tfpar.testing import reference_runs


def ensure_devices(count: int) -> None:
    """Provides at least ``count`` logical CPU devices; call it before TensorFlow runs an op.

    Call it at module import (or in ``setUpModule``), or let the pytest plugin do it with
    ``--tfpar-devices=N``: pytest imports many test modules into one process, and the first
    TensorFlow op fixes the device count for all of them.

    Args:
        count: Number of logical CPU devices needed.

    Raises:
        DeviceError: If TensorFlow has already initialised with fewer devices; the message
            says how to fix it.
    """
    try:
        devices.ensure_logical_cpus(count)
    except DeviceError as e:
        raise DeviceError(
            f"{e} In a test suite: call tfpar.testing.ensure_devices({count}) at the top of the "
            f"test module, or run pytest with --tfpar-devices={count} (or set tfpar_devices = "
            f"{count} in the [pytest] section of your config).") from None


def _skip_reason(choice: StrategyChoice, num_devices: int) -> str | None:
    entry, name = choice.entry, choice.name
    if entry.multi_process:
        return (f"strategy {name!r} runs several worker processes; test it with "
                "tfpar.cluster.launcher (tfpar-launch) instead of in-process")
    if entry.max_devices is not None and num_devices > entry.max_devices:
        return f"strategy {name!r} runs on at most {entry.max_devices} device(s)"
    if entry.requires_gpu and devices.gpu_count() < num_devices:
        return (f"strategy {name!r} needs {num_devices} GPU(s); this machine has "
                f"{devices.gpu_count()}")
    if num_devices > devices.logical_cpu_count() and devices.gpu_count() < num_devices:
        return (f"{num_devices} devices asked for but only {devices.logical_cpu_count()} logical "
                f"CPU devices exist; run pytest with --tfpar-devices={num_devices}")
    return None


def for_each_strategy(num_devices: Iterable[int] = (1, 2),
                      names: Iterable[str] | None = None) -> Callable:
    """Parameterises a test over registry strategies and device counts.

    The test receives ``strategy_name`` and ``num_devices``; cases are named
    ``test_<name>_<strategy>_<count>``. Combinations that cannot run here (several processes,
    too many devices for the entry, missing GPUs) still appear, and skip with the reason.

    Args:
        num_devices: Device counts to run each strategy on.
        names: Strategy names (every registered one when ``None``).

    Returns:
        A decorator for test methods of a :class:`StrategyTestCase`.
    """
    chosen = list(names) if names is not None else list(strategies.available())
    cases = [{"testcase_name": f"_{name}_{count}", "strategy_name": name, "num_devices": count}
             for name in chosen for count in num_devices]
    return parameterized.named_parameters(*cases)


class StrategyTestCase(tf.test.TestCase, parameterized.TestCase):
    """A ``tf.test.TestCase`` with strategies by name and distributed-training assertions.

    Attributes:
        NUM_DEVICES: Logical CPU devices the class needs; provided in ``setUpClass`` when
            TensorFlow has not initialised yet (else see :func:`ensure_devices`).
    """

    NUM_DEVICES = 2

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        ensure_devices(cls.NUM_DEVICES)

    def strategy(self, name: str, num_devices: int = 2, **options) -> tf.distribute.Strategy:
        """Returns ``tfpar.strategies.get(name, num_devices)``, or skips the test with the reason
        the combination cannot run on this machine."""
        choice = strategies.choose(name, **options)  # Resolved once.
        reason = _skip_reason(choice, num_devices)
        if reason:
            self.skipTest(reason)
        return choice.build(num_devices)

    def assertReplicasInSync(self, model: keras.Model, rtol: float = 0.0,
                             atol: float = 0.0) -> None:
        """Asserts every replica holds the same value of every variable of ``model``.

        Args:
            model: A model built under a strategy scope.
            rtol: Relative tolerance (0: bit-identical).
            atol: Absolute tolerance.
        """
        strategy = model.distribute_strategy
        for variable in model.variables:
            copies = [np.asarray(v) for v in
                      strategy.experimental_local_results(getattr(variable, "value", variable))]
            for replica, copy in enumerate(copies[1:], start=1):
                self.assertAllClose(
                    copies[0], copy, rtol=rtol, atol=atol,
                    msg=f"{variable.path}: replica {replica} differs from replica 0")

    def assertMatchesSingleDevice(self, model_fn: Callable[[], keras.Model],
                                  dataset: tf.data.Dataset, strategy: tf.distribute.Strategy,
                                  *, train: reference_runs.TrainFn | None = None,
                                  rtol: float | None = None, atol: float | None = None,
                                  reference_train: reference_runs.TrainFn | None = None
                                  ) -> None:
        """Asserts training under ``strategy`` equals training on one device.

        ``model_fn`` is called twice: outside any strategy (the reference) and under
        ``strategy``; both models start from the reference's initial weights, train one pass
        over ``dataset`` (the same global batches), and must end with the same losses and
        weights, and the distributed one with every replica in sync.

        Args:
            model_fn: Returns a new compiled model (new optimizer too).
            dataset: Global batches (e.g. :func:`tiny_dataset`); a few steps suffice.
            strategy: The strategy under test, with its options (from
                ``tfpar.strategies.get``, or any ``tf.distribute.Strategy``).
            train: The training function under ``strategy`` (``model.fit`` by default);
                ``train(model, dataset, strategy)`` returns the per-step losses, or ``None``
                to compare weights only. Weights only are compared, too, for registry entries
                whose logged loss Keras gets wrong (``StrategyEntry.logs_exact_loss``).
            reference_train: The training function on one device (``model.fit`` by
                default); pass the same as ``train`` where it trains with more than the data
                (``class_weight``, callbacks).
            rtol: Relative tolerance; by default that of the model's dtype policy, or of a
                layer's where wider (:data:`TOLERANCES`: 1e-5 in float32, 1e-2 in bfloat16
                and a mixed policy).
            atol: Absolute tolerance; by default that of the model's dtype policy (1e-6 in
                float32, 1e-3 in a mixed policy).

        With the default tolerances, a weight that differs by more than they allow is checked
        once more against how far rounding alone moves it on this model, optimizer and CPU:
        the reference is trained again with each batch's examples in reverse order (the same
        computation, its sums in another order, as replicas summing their shards take them),
        and a weight may differ from the reference by :data:`ROUNDING_MARGIN` times what that
        moved it. An adaptive optimizer (Adam divides by ``sqrt(v) + epsilon``) turns the
        rounding of a near-zero gradient into a change of up to its learning rate, so a fixed
        tolerance either fails on a CPU whose kernels round otherwise or lets errors pass
        everywhere; a wrong computation moves a weight far beyond rounding's reach. A model
        with Dropout draws its masks for other examples in that run, which widens the reach.
        Explicit ``rtol`` or ``atol`` turn this off.
        """
        train = train or reference_runs.fit_steps
        measure_rounding = rtol is None and atol is None
        chosen = _made_from(strategy)
        compare_losses = chosen is None or chosen.entry.logs_exact_loss
        reference = model_fn()
        # The widest of the model's policy and its layers' (a layer may compute in bfloat16
        # in a float32 model).
        default_rtol, default_atol = max(
            TOLERANCES.get(policy.name, TOLERANCES["float32"])
            for policy in [reference.dtype_policy,
                           *(layer.dtype_policy for layer in reference.layers)])
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol
        initial = reference.get_weights()
        with strategy.scope():
            model = model_fn()
        model.set_weights(initial)
        reference_train = reference_train or reference_runs.fit_steps
        expected_losses = reference_train(reference, dataset, tf.distribute.get_strategy())
        losses = train(model, dataset, strategy)
        if losses is not None and compare_losses:
            self.assertAllClose(expected_losses, losses, rtol=rtol, atol=atol,
                                msg="per-step losses differ from single-device training")
        expected_weights, actual_weights = reference.get_weights(), model.get_weights()
        beyond = [i for i, (expected, actual) in enumerate(zip(expected_weights, actual_weights))
                  if not np.allclose(actual, expected, rtol=rtol, atol=atol)]
        reach = None
        if beyond and measure_rounding:
            reach = _rounding_reach(model_fn, initial, dataset, expected_weights,
                                    reference_train)
        for i, (expected, actual, variable) in enumerate(zip(expected_weights, actual_weights,
                                                             model.weights)):
            if reach is not None and i in beyond:
                allowed = ROUNDING_MARGIN * reach[i] + atol
                worst = float(np.max(np.abs(actual.astype(np.float64) - expected)))
                self.assertLessEqual(
                    worst, allowed + rtol * float(np.max(np.abs(expected))),
                    f"{variable.path} differs from single-device training by {worst:.3g}, "
                    f"beyond rounding's reach on this model and optimizer ({ROUNDING_MARGIN} x "
                    f"{reach[i]:.3g}: how far summing each batch in another order moved it)")
                continue
            self.assertAllClose(expected, actual, rtol=rtol, atol=atol,
                                msg=f"{variable.path} differs from single-device training")
        self.assertReplicasInSync(model, rtol=rtol, atol=atol)


    def assertSameOnAnyWorldSize(self, model_fn: Callable[[], keras.Model],
                                 dataset: tf.data.Dataset, *, virtual_replicas: int = 4,
                                 num_devices: Sequence[int] = (1, 2, 4),
                                 entry: str = "allreduce", seed: int = 0,
                                 train: reference_runs.TrainFn | None = None) -> None:
        """Asserts training with ``virtual_replicas`` ends bit for bit the same on each number
        of devices: every variable of the model and its optimizer, on every replica.

        The exact assertion of world-size invariance (no tolerance): ``model_fn`` is called
        once per device count, under ``entry`` with ``virtual_replicas``, each model starting
        from the first's initial weights and random generators (``seed``), trained one pass
        over ``dataset``.

        Args:
            model_fn: Returns a new compiled model (new optimizer too).
            dataset: Global batches; a few steps suffice.
            virtual_replicas: The shards of each batch.
            num_devices: The device counts compared (each must divide ``virtual_replicas``);
                the first is the reference.
            entry: The registry entry (an all-reduce entry).
            seed: Seeds Keras's random generators before each model is built.
            train: The training function (``model.fit`` by default), as in
                :meth:`assertMatchesSingleDevice`.
        """
        train = train or reference_runs.fit_steps
        reference: dict[int, tuple[str, list[np.ndarray]]] | None = None
        initial = None
        for count in num_devices:
            strategy = strategies.get(entry, devices=count, virtual_replicas=virtual_replicas)
            keras.utils.set_random_seed(seed)
            with strategy.scope():
                model = model_fn()
            if initial is None:
                initial = model.get_weights()
            model.set_weights(initial)
            train(model, dataset, strategy)
            values = _every_copy(model)
            if reference is None:
                reference, first = values, count
                continue
            self.assertEqual(len(values), len(reference))
            differ = []
            for place, (path, copies) in values.items():
                for replica, copy in enumerate(copies):
                    expected = reference[place][1][0]
                    if not np.array_equal(np.atleast_1d(copy).view(np.uint8),
                                          np.atleast_1d(expected).view(np.uint8)):
                        worst = float(np.max(np.abs(np.asarray(copy, np.float64) - expected),
                                             initial=0.0))
                        differ.append(f"{path} (replica {replica}: {worst:.3g} apart)")
            self.assertEqual(differ, [], f"variables on {count} devices that differ from "
                                         f"{first} device(s) with virtual_replicas="
                                         f"{virtual_replicas}")

    def assertKeepsPromise(self, case: generated_models.ModelCase, entry: str, num_devices: int,
                           *, virtual_replicas: int = 0) -> str:
        """Asserts ``entry`` on ``num_devices`` keeps its promise for ``case``, or refuses it in
        one line.

        The promise is :meth:`ModelCase.expected_promise
        <tfpar.testing.generated_models.ModelCase.expected_promise>`'s: with
        ``virtual_replicas``, :meth:`assertSameOnAnyWorldSize` between 1 device and
        ``num_devices``; else :meth:`assertMatchesSingleDevice`, or, where per-replica
        BatchNorm statistics or random streams make one device another computation (and
        Keras's step on uneven batches), every replica's weights and optimizer state the same
        and every copy of every variable finite. A refusal is
        a :class:`~tfpar.errors.TfparError` raised with a one-line message; any other error
        fails the test.

        Args:
            case: The model and fit.
            entry: An in-process registry entry.
            num_devices: The devices it trains on.
            virtual_replicas: The shards of each batch (0: off; an all-reduce entry's option).

        Returns:
            The promise kept, or ``"refused"``.
        """
        promise = case.expected_promise(entry, num_devices, virtual_replicas)
        options = {"virtual_replicas": virtual_replicas} if virtual_replicas else {}
        try:
            if promise == "same_on_any_world_size":
                self.assertSameOnAnyWorldSize(
                    case.build, case.dataset(), virtual_replicas=virtual_replicas,
                    num_devices=(1, num_devices), entry=entry, seed=case.seed,
                    train=case.train)
            elif promise == "matches_one_device":
                self.assertMatchesSingleDevice(case.build, case.dataset(),
                                               self.strategy(entry, num_devices, **options),
                                               train=case.train, reference_train=case.train)
            else:
                strategy = self.strategy(entry, num_devices, **options)
                with strategy.scope():
                    model = case.build()
                case.train(model, case.dataset())
                # Every replica's copy of what the update writes is the same, and of the
                # random generators' states (a replica without examples ends where the others
                # do); a layer's own state (BatchNorm's statistics) is per replica by design,
                # and finite.
                updated = {id(v) for v in [
                    *model.trainable_variables, *model.optimizer.variables,
                    *(v for v in model.non_trainable_variables
                      if v.path.endswith("seed_generator_state"))]}
                for place, (path, copies) in _every_copy(model).items():
                    for replica, copy in enumerate(copies):
                        self.assertTrue(np.all(np.isfinite(np.asarray(copy, np.float64))),
                                        f"{path} is not finite on replica {replica}")
                        if place < len(model.variables) and id(model.variables[place]) \
                                not in updated:
                            continue
                        self.assertTrue(np.array_equal(copy, copies[0]),
                                        f"{path}: replica {replica} differs from replica 0")
        except TfparError as e:
            self.assertNotIn("\n", str(e), f"a refusal of {case} in more than one line")
            return "refused"
        return promise


def _every_copy(model: keras.Model) -> dict[int, tuple[str, list[np.ndarray]]]:
    """Every variable of ``model`` and its optimizer, each replica's copy, by place (two
    builds of a model number their layers apart), with its path."""
    values = {}
    for place, variable in enumerate([*model.variables, *model.optimizer.variables]):
        tensor = getattr(variable, "value", variable)
        copies = getattr(tensor, "values", (tensor,))
        values[place] = (variable.path, [np.asarray(copy.numpy()) for copy in copies])
    return values


TOLERANCES = {"float32": (1e-5, 1e-6), "mixed_float16": (1e-2, 1e-3),
              "mixed_bfloat16": (1e-2, 1e-3), "bfloat16": (1e-2, 1e-3)}
""": The default ``(rtol, atol)`` of :meth:`StrategyTestCase.assertMatchesSingleDevice` by the :
model's Keras dtype policy (or a layer's): bfloat16 and a mixed policy compute in 16 bits :
(bfloat16 keeps 8 bits of mantissa), so replicas that compute on shards of a batch round :
differently from one device that computes on the whole batch.
"""


ROUNDING_MARGIN = 4.0
"""How many times rounding's measured reach a weight may differ from one device's by, where it
differs by more than the default tolerance (``assertMatchesSingleDevice``): the measuring run
takes one other order of the sums, a distributed run another again."""


def _rounding_reach(model_fn: Callable[[], keras.Model], initial: list[np.ndarray],
                    dataset: tf.data.Dataset, expected: list[np.ndarray],
                    train: reference_runs.TrainFn = reference_runs.fit_steps) -> list[float]:
    """How far, per weight, one device's training moves from ``expected`` when each batch's
    examples come in reverse order: the same computation, its sums taken in another order,
    as replicas that sum their shards take them. The reach of rounding on this model,
    optimizer and CPU."""
    reordered = model_fn()
    reordered.set_weights(initial)

    def reverse(*batch):
        return tf.nest.map_structure(lambda tensor: tf.reverse(tensor, [0]), batch)

    train(reordered, dataset.map(reverse), tf.distribute.get_strategy())
    return [float(np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0))
            for a, b in zip(reordered.get_weights(), expected)]


def _made_from(strategy: tf.distribute.Strategy) -> strategies.Selection | None:
    """What the registry made ``strategy`` from, or ``None`` for a strategy made elsewhere."""
    try:
        return strategies.selection(strategy)
    except RegistryError:
        return None
