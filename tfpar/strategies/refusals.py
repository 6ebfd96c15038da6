"""What tfpar's strategies cannot run, as data: each :class:`Refusal` checks the Keras step a
strategy is asked to run and raises one line naming the alternative (or warns once where the
step trains, but not as on one device).

A strategy class lists its refusals in :attr:`tfpar.strategies.base.TfparStrategy.refusals`;
the base class checks them once per ``Strategy.run`` of a model's step. As of TensorFlow 2.21
/ Keras 3.15:

- :data:`KERAS_UPDATE_IN_COND` (every ``MirroredStrategy``-family strategy running a step that
  calls ``optimizer.apply``: Keras's own ``train_step`` under ``mirrored``, ``central_storage``
  and ``multi_worker``; a model's own ``train_step`` under every entry):
  ``gradient_accumulation_steps`` and ``ema_overwrite_frequency``. Keras applies them inside
  ``tf.cond``, where TensorFlow forbids the cross-replica update (``RuntimeError: merge_call
  called while defining a new graph``), even on one device.
- :data:`REPLICA_ASSIGNS` (``central_storage``): variable constraints. Keras assigns the
  trainable variables in the replica context, which ``CentralStorageStrategy`` forbids for
  variables without an aggregation (``ValueError: You must specify an aggregation method``);
  non-trainable ones (``use_ema``'s averages, layers' state) get one in its scope
  (:func:`tfpar.strategies.central_storage.aggregated_state`).
- :data:`CLIPPING_PER_REPLICA` (warned once, several replicas): ``clipnorm``,
  ``global_clipnorm``, ``clipvalue``. Keras clips each replica's gradient before the
  all-reduce, so training differs from one device.
- :data:`MULTI_STEP_EXECUTION` (several workers): ``steps_per_execution > 1`` where tfpar's
  fix of Keras's multi-step loop across workers is not applied (a Keras or TensorFlow outside
  the versions it was verified against; :mod:`tfpar.compat.keras_fixes`).
- :data:`XLA_ON_CPU_REPLICAS` (every tfpar strategy, :attr:`TfparStrategy.common_refusals`):
  ``jit_compile=True`` on several replicas with a CPU among them (see :func:`check_xla`).
- :data:`MODEL_BUILT_ELSEWHERE` (every tfpar strategy): a model built outside the strategy its
  step runs under (TensorFlow fails deep in the update with a bare ``AssertionError``).

The all-reduce step (Keras's ``train_step`` under ``allreduce`` and ``multi_worker_allreduce``)
applies every optimizer feature above exactly (:mod:`tfpar.allreduce.step`), so the optimizer
refusals do not apply to it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import keras
import tensorflow as tf

from tfpar.allreduce import step as allreduce_step
from tfpar.compat import collective_keys
from tfpar.compat import keras_fixes
from tfpar.errors import ConfigError
from tfpar.errors import InexactUpdateWarning

if TYPE_CHECKING:
    # What a refusal reads of a strategy: a tf.distribute.Strategy with the sentence that
    # names the alternative (tfpar.strategies.base.TfparStrategy is one).
    class TfparStrategy(tf.distribute.Strategy):
        refusal_alternative: str

KERAS_STEPS = ("train_step", "test_step", "predict_step")
""": The model methods Keras's ``fit``, ``evaluate`` and ``predict`` pass to ``Strategy.run``."""


@dataclasses.dataclass(frozen=True)
class KerasStep:
    """A model's step that Keras asked a strategy to run.

    Attributes:
        model: The model.
        name: ``"train_step"``, ``"test_step"`` or ``"predict_step"``.
        is_keras_own: Whether it is Keras's own method (the model's class does not override it).
        replaced: Whether the strategy runs a step of its own in its place (the all-reduce
            step for Keras's ``train_step``).
    """

    model: keras.Model
    name: str
    is_keras_own: bool
    replaced: bool = False

    @classmethod
    def of(cls, fn: Any) -> KerasStep | None:
        """The step ``fn`` is, if it is a bound step method of a Keras model, else ``None``."""
        model = getattr(fn, "__self__", None)
        name = getattr(fn, "__name__", "")
        if not isinstance(model, keras.Model) or name not in KERAS_STEPS:
            return None
        return cls(model, name, getattr(fn, "__func__", None) is getattr(keras.Model, name))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One thing a strategy cannot run, checked on the steps it applies to.

    Attributes:
        name: A short name (for listings and tests).
        steps: The step names it checks.
        check: ``check(strategy, step)``: raises :class:`~tfpar.errors.ConfigError` (or warns)
            for what the strategy cannot run.
        checks_replaced_steps: Whether it also checks a step the strategy replaced with its
            own (the optimizer refusals do not: the all-reduce step applies them exactly).
    """

    name: str
    steps: tuple[str, ...]
    check: Callable[[TfparStrategy, KerasStep], None]
    checks_replaced_steps: bool = True

    def __call__(self, strategy: TfparStrategy, step: KerasStep) -> None:
        """Checks ``step`` under ``strategy`` if this refusal applies to it."""
        if step.name in self.steps and (self.checks_replaced_steps or not step.replaced):
            self.check(strategy, step)


def _optimizer(model: keras.Model) -> Any:
    """The model's optimizer (the inner one of a ``LossScaleOptimizer``), or ``None``."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _update_in_cond(strategy: TfparStrategy, step: KerasStep) -> None:
    optimizer = _optimizer(step.model)
    if optimizer is None:
        return
    in_cond = [f"{name}={getattr(optimizer, name)}"
               for name in ("gradient_accumulation_steps", "ema_overwrite_frequency")
               if getattr(optimizer, name, None) and (
                   name != "ema_overwrite_frequency" or optimizer.use_ema)]
    if in_cond:
        raise ConfigError(
            f"The optimizer's {' and '.join(in_cond)} fails under tf.distribute's mirrored "
            "strategies (Keras applies it inside tf.cond, where TensorFlow forbids the "
            f"cross-replica update). {strategy.refusal_alternative}")


def _replica_assigns(strategy: TfparStrategy, step: KerasStep) -> None:
    optimizer = _optimizer(step.model)
    if optimizer is None:
        return
    constrained = [v.path for v in step.model.trainable_variables
                   if getattr(v, "constraint", None) is not None]
    if constrained:
        raise ConfigError(
            f"Keras cannot apply constraints on {', '.join(constrained)} under "
            "'central_storage' (it assigns the variables where the strategy forbids it). Train "
            "with 'mirrored' or 'allreduce'.")


def _clipping_per_replica(strategy: TfparStrategy, step: KerasStep) -> None:
    optimizer = _optimizer(step.model)
    if (optimizer is None or strategy.num_replicas_in_sync == 1
            or getattr(strategy, "_clipping_warned", False)):
        return
    clipping = [f"{name}={getattr(optimizer, name)}"
                for name in ("clipnorm", "global_clipnorm", "clipvalue")
                if getattr(optimizer, name, None)]
    if clipping:
        strategy._clipping_warned = True
        warnings.warn(
            f"The optimizer's {clipping[0]} clips each replica's gradient before the "
            "all-reduce under Keras's train_step, so training differs from one device. "
            "The 'allreduce' strategy clips the all-reduced gradient, as one device "
            "does.", InexactUpdateWarning, stacklevel=4)


def check_xla(jit_compile: Any, strategy: tf.distribute.Strategy) -> None:
    """Raises for XLA (``jit_compile``) on several replicas with a CPU among them.

    Keras compiles the whole step, the all-reduce included: in one process XLA cannot reach
    another CPU device's variables (``InvalidArgumentError`` deep in the graph), and across
    workers TensorFlow 2.21 compiles no collective between CPUs ("Collectives are not yet
    implemented for CPU devices when compiling with XLA"; the worker then aborts). On GPUs,
    and on one replica, XLA runs.

    Raises:
        ConfigError: Naming the setting (``{argument}``: ``jit_compile``) and what runs.
    """
    replicas = strategy.num_replicas_in_sync
    if jit_compile is not True or replicas == 1 or all(
            tf.DeviceSpec.from_string(device).device_type == "GPU"
            for device in strategy.extended.worker_devices):
        return
    raise ConfigError(f"{{argument}}=True cannot run on {replicas} replicas with CPUs among "
                      "them: XLA compiles the step with its all-reduce, which TensorFlow's XLA "
                      "cannot do between CPU devices. Use {argument}=False, one device, or "
                      "GPUs.", argument="jit_compile")


def _xla_on_cpu_replicas(strategy: TfparStrategy, step: KerasStep) -> None:
    check_xla(step.model.jit_compile, strategy)


def _model_built_elsewhere(strategy: TfparStrategy, step: KerasStep) -> None:
    variables = step.model.trainable_variables
    if not variables:
        return
    value = getattr(variables[0], "value", variables[0])
    if strategy.extended.variable_created_in_scope(value):
        return
    # Refused while Keras traces its train function: a new one is made for the next fit (which
    # may run where the model was built), not this one traced again.
    step.model.train_function = None
    raise ConfigError(
        f"The model {step.model.name!r} was built outside the strategy its {step.name} runs "
        f"under ({type(strategy).__name__}), whose replicas hold no copies of its variables. "
        "Build it in the strategy's scope (or while the keras.distribution distribution is "
        "set), or run it where it was built (after "
        "keras.distribution.set_distribution(None), or outside the other scope).")


KERAS_STEP_EMPTY_REPLICA = (
    "A batch left a replica without examples, and the step of Keras (which this entry runs) "
    "runs the model there, which this model cannot do: on CPU devices a convolution fails "
    "(with oneDNN) or trains on uninitialised memory (a depthwise one, without it), and the "
    "moving statistics of BatchNormalization become NaN; give every batch at least as many "
    "examples as replicas (drop_remainder=True, or a batch size that leaves a last batch that "
    "large), or train with allreduce, whose step skips an empty shard.")
"""The refusal of Keras's step on a replica without examples, for a model that cannot run
there. No quote marks: TensorFlow escapes them in an assertion's text."""


def empty_replica_fails(strategy: tf.distribute.Strategy, step: KerasStep) -> bool:
    """Whether ``step`` (Keras's, run on every replica) fails or goes wrong on a replica
    without examples: the model holds a convolution's kernel (three or more dimensions) on CPU
    devices, or, training, a BatchNormalization that is not synchronized."""
    if strategy.num_replicas_in_sync == 1:
        return False
    model = step.model
    convolves = allreduce_step.empty_shard_fails(model)  # The all-reduce step's rule, shared.
    normalizes = step.name == "train_step" and any(
        isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
        for layer in _layers(model))
    return convolves or normalizes


def _layers(layer: Any, seen: set[int] | None = None) -> list[Any]:
    """``layer`` and every layer it holds (in ``layers``, or as an attribute)."""
    seen = set() if seen is None else seen
    if id(layer) in seen or not isinstance(layer, keras.layers.Layer):
        return []
    seen.add(id(layer))
    found = [layer]
    held = list(getattr(layer, "layers", None) or ())
    for value in vars(layer).values():
        held += value if isinstance(value, (list, tuple)) else [value]
    for inner in held:
        found += _layers(inner, seen)
    return found


def _multi_step_execution(strategy: TfparStrategy, step: KerasStep) -> None:
    steps = step.model.steps_per_execution
    if steps == 1 or strategy.num_replicas_in_sync == len(strategy.extended.worker_devices):
        return
    reason = (keras_fixes.unavailable("multi_step_train_function")
              or collective_keys.skip_reason())
    if reason:
        raise ConfigError("{argument} > 1 runs across workers only with tfpar's fix of Keras's "
                          "multi-step loop (keras-team/keras#19246), not applied here: "
                          f"{reason}. Use {{argument}}=1. Received: {{argument}}={steps}.",
                          argument="steps_per_execution")


def _own_step_with_virtual_replicas(strategy: TfparStrategy, step: KerasStep) -> None:
    virtual = getattr(getattr(strategy, "step_options", None), "virtual_replicas", 0)
    if step.is_keras_own or not virtual:
        return
    raise ConfigError(
        f"virtual_replicas={virtual} cannot train a model with its own "
        f"train_step ({type(step.model).__name__}.train_step): the same weights on any "
        "number of replicas need the step that cuts each batch into the shards, which a "
        "model's own step does not. Use Keras's train_step (override compute_loss instead), "
        "or train without virtual_replicas.")


KERAS_UPDATE_IN_COND = Refusal("keras_update_in_cond", ("train_step",), _update_in_cond,
                               checks_replaced_steps=False)
""": ``gradient_accumulation_steps`` and ``ema_overwrite_frequency`` in a step that calls the :
optimizer: refused under every mirrored-family strategy.
"""
REPLICA_ASSIGNS = Refusal("replica_assigns", ("train_step",), _replica_assigns,
                          checks_replaced_steps=False)
""": Variable constraints: refused under ``central_storage``."""
CLIPPING_PER_REPLICA = Refusal("clipping_per_replica", ("train_step",), _clipping_per_replica,
                               checks_replaced_steps=False)
""": Gradient clipping before the all-reduce: warned once on several replicas."""
MULTI_STEP_EXECUTION = Refusal("multi_step_execution", KERAS_STEPS, _multi_step_execution)
""": ``steps_per_execution > 1``: refused across workers where tfpar's fix is not applied."""
XLA_ON_CPU_REPLICAS = Refusal("xla_on_cpu_replicas", KERAS_STEPS, _xla_on_cpu_replicas)
""": ``jit_compile=True`` on several replicas with a CPU among them: refused by every strategy."""
MODEL_BUILT_ELSEWHERE = Refusal("model_built_elsewhere", ("train_step",), _model_built_elsewhere)
""": A model whose variables were created outside the strategy it runs under (built without
the ``keras.distribution`` distribution set when ``fit`` runs): refused by every strategy."""

OWN_STEP_WITH_VIRTUAL_REPLICAS = Refusal("own_step_with_virtual_replicas", ("train_step",),
                                         _own_step_with_virtual_replicas)
""": A model's own ``train_step`` under ``virtual_replicas``: refused by the all-reduce
strategies."""

KERAS_OPTIMIZER_UPDATE = (KERAS_UPDATE_IN_COND, CLIPPING_PER_REPLICA)
""": What a strategy running Keras's own optimizer update under ``MirroredStrategy`` refuses."""
