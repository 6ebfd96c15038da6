"""Datasets and input pipelines.

- :mod:`.catalog`: which datasets exist, their shapes and sources (no TensorFlow);
- :mod:`.loading`: :func:`load` gives a dataset's unbatched splits;
- :mod:`.pipelines`: batching by the global batch size, per-epoch orders, distribution.

Example::

    splits = tfpar.data.load("digits")
    model.fit(tfpar.data.pipeline(splits.train, 64, shuffle=True), epochs=2)
"""

from tfpar import lazy_exports

lazy_exports.install(__name__, {
    "available": "catalog",
    "Splits": "loading", "load": "loading", "check_image_shape": "loading",
    "pipeline": "pipelines", "epoch_stream": "pipelines", "epoch_batches": "pipelines",
    "distribute": "pipelines",
})
