"""The mixin every strategy class of tfpar's inherits: its input iterators are freed on
background threads, so ``fit`` and its epochs end when their last step does (the mechanism
and its version gate: :mod:`tfpar.compat.iterator_release`).

A strategy class of your own inherits :class:`ReleasesIteratorsInBackground` before the
``tf.distribute`` class.
"""

from __future__ import annotations

from tfpar.compat.iterator_release import releasing_iterators
from tfpar.strategies.mixin_base import StrategyMixin


class ReleasesIteratorsInBackground(StrategyMixin):
    """Mixin for a ``tf.distribute`` strategy: its distributed datasets' iterators are freed
    on background threads (see :mod:`tfpar.compat.iterator_release`), so ``fit`` and its
    epochs end when their last step does."""

    def experimental_distribute_dataset(self, dataset, options=None):
        """``Strategy.experimental_distribute_dataset``, iterators freed in the background."""
        return releasing_iterators(super().experimental_distribute_dataset(dataset, options))

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``Strategy.distribute_datasets_from_function``, iterators freed in the
        background."""
        return releasing_iterators(super().distribute_datasets_from_function(dataset_fn,
                                                                             options))
