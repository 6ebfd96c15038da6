"""The base class of tfpar's strategy mixins: ``object`` at run time, a
``tf.distribute.Strategy`` for type checkers, which then see the strategy's attributes
(``run``, ``extended``, ``num_replicas_in_sync``) that every mixin relies on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

    StrategyMixin = tf.distribute.Strategy
else:
    StrategyMixin = object
