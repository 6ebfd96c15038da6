"""How the vendored Keras tests in this folder build their strategy: a tfpar entry by name.

Each vendored test class gets ``make_strategy`` (in place of the original's
``tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])``) and ``ENTRY = "mirrored"``; its
subclasses run the same tests under other entries, skipping with a reason those in their
``NOT_APPLICABLE``.
"""

from tfpar import strategies


def make_strategy(test):
    """Returns the test class's ``ENTRY`` on 2 devices, or skips the test with its reason."""
    reason = getattr(test, "NOT_APPLICABLE", {}).get(test._testMethodName)
    if reason:
        test.skipTest(reason)
    return strategies.get(test.ENTRY, 2)


def run_under_tfpar(test_class):
    """Makes ``test_class`` build its strategy with :func:`make_strategy`, as ``mirrored``."""
    test_class.ENTRY = "mirrored"
    test_class.make_strategy = make_strategy
