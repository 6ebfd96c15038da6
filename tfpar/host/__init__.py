"""The host: what machine this is and how its CPU threads are laid out.

- :mod:`.machine`: the CPU's identity (model, vector extensions, the low precisions it runs
  natively), read at run time, and package versions;
- :mod:`.thread_layouts`: thread layouts over logical CPU devices and worker processes, and the
  layout each machine kind was tuned to.

No TensorFlow at import.
"""

from tfpar import lazy_exports

lazy_exports.install(__name__)
