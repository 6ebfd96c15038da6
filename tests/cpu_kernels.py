"""Which kernels this process's CPU settings leave out, for the tests that need them.

A test run with oneDNN capped below AVX-512 on an AVX-512 CPU (how the suite runs an AVX2 CPU's
kernels here: ``TF_ENABLE_ONEDNN_OPTS=1 ONEDNN_MAX_CPU_ISA=AVX``) has no bfloat16
convolution, because TensorFlow hands oneDNN its bfloat16 ops by the CPU's flags, not the cap.
On an AVX2 CPU itself TensorFlow keeps bfloat16 on Eigen's kernels, and these tests run.
"""

from __future__ import annotations

import pytest

from tfpar.host import onednn
from tfpar.host.machine import cpu_flags

BFLOAT16_WITHOUT_KERNELS = onednn.bfloat16_without_kernels(onednn.current(), cpu_flags())
"""Whether bfloat16 convolutions have no kernel in this process."""
BFLOAT16_REASON = (f"{onednn.CAP_ENV}={onednn.current().cap} on an AVX-512 CPU leaves bfloat16 "
                   "convolutions without a kernel (an emulation of a narrower CPU)")
"""The skip reason."""

needs_bfloat16_kernels = pytest.mark.skipif(BFLOAT16_WITHOUT_KERNELS, reason=BFLOAT16_REASON)
"""Skips a test or class that trains in bfloat16 where it has no kernels."""
