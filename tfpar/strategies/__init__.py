"""Strategies by name: the registry (:mod:`.registry`) and its built-in entries (:mod:`.builtin`).

Example::

    strategy = tfpar.strategies.get("mirrored", devices=2)
    with strategy.scope():
        model = ...

No TensorFlow at import: listing entries and checking names and options is instant.
"""

from tfpar import lazy_exports
from tfpar.strategies import builtin  # noqa: F401  (registers the built-in entries)
from tfpar.strategies.registry import ENTRY_POINT_GROUP
from tfpar.strategies.registry import Selection
from tfpar.strategies.registry import StrategyChoice
from tfpar.strategies.registry import StrategyEntry
from tfpar.strategies.registry import available
from tfpar.strategies.registry import choose
from tfpar.strategies.registry import entry
from tfpar.strategies.registry import get
from tfpar.strategies.registry import register
from tfpar.strategies.registry import selection
from tfpar.strategies.registry import unregister

__all__ = ["ENTRY_POINT_GROUP", "Selection", "StrategyChoice", "StrategyEntry", "available",
           "choose", "entry", "get", "register", "selection", "unregister"]

lazy_exports.install(__name__)
