"""Throughput benchmark: steady-state images/s of configurations side by side, measured honestly.

- :mod:`.measurements`: what is measured (configurations, sweeps, measurements, paired ratios);
- :mod:`.runner`: runs each configuration in processes of its own, in interleaved rounds;
- :mod:`.worker`: the program each of those processes runs;
- :mod:`.report`: the table, CSV, JSON and PNG;
- :mod:`.flops`: training FLOPs per image, for GFLOP/s.

No TensorFlow at import except in :mod:`.worker` and :mod:`.flops`.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__, {
    "BASELINE": "measurements", "CEILING": "measurements", "Configuration": "measurements",
    "PlainKeras": "measurements", "Ceiling": "measurements", "Runs": "measurements",
    "Measurement": "measurements", "configurations": "measurements",
    "paired_ratio": "measurements",
    "run": "runner",
    "table": "report", "plot": "report", "write_csv": "report", "write_json": "report",
})
