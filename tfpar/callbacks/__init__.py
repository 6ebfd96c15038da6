"""The Keras callbacks a tfpar run uses; each works under every registry entry.

- :mod:`.timing`: :class:`EpochTimer`, seconds per epoch and images/s;
- :mod:`.non_finite_loss`: :class:`StopOnNonFiniteLoss`, stops on a NaN or infinite loss;
- :mod:`.profiling`: :class:`ProfileSteps`, traces steps for TensorBoard's profiler;
- :mod:`.checkpointing`: :class:`EpochCheckpoint`, kill-and-resume (at an epoch's end or
  inside it);
- :mod:`.save_interval`: the automatic interval of saves inside an epoch (``save_every_steps=
  "auto"``), within a budget of the training time;
- :mod:`.save_on_preemption`: :class:`SaveOnPreemption`, the state saved at the step a preemption
  notice stops the job at;
- :mod:`.batchnorm_statistics`: :class:`AverageAtEpochEnd`, replicas' BatchNorm statistics
  averaged before evaluating and saving.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__, {
    "EpochTimer": "timing", "StopOnNonFiniteLoss": "non_finite_loss",
    "ProfileSteps": "profiling", "EpochCheckpoint": "checkpointing",
    "SaveOnPreemption": "save_on_preemption",
    "AverageAtEpochEnd": "batchnorm_statistics",
})
