"""Tests of the FLOP count: analytic for LeNet, and cross-checked with TensorFlow's profiler."""

import tensorflow as tf
from absl.testing import parameterized

from tfpar import models
from tfpar.benchmark import flops


def profiler_forward_flops(model, input_shape):
    """FLOPs TensorFlow's graph profiler counts for one image's forward pass."""

    @tf.function
    def forward(x):
        return model(x, training=False)

    graph = forward.get_concrete_function(tf.TensorSpec([1, *input_shape])).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return tf.compat.v1.profiler.profile(graph=graph, options=options).total_float_ops


class FlopsTest(tf.test.TestCase, parameterized.TestCase):

    def test_lenet_by_hand(self):
        model = models.lenet()
        conv1 = 2 * 3 * 3 * 1 * 20 * 26 * 26 + 20 * 26 * 26   # 256,880
        pool1 = 20 * 13 * 13
        conv2 = 2 * 5 * 5 * 20 * 50 * 9 * 9 + 50 * 9 * 9       # 4,054,050
        pool2 = 50 * 4 * 4
        dense = 2 * 800 * 128 + 128 + 2 * 128 * 10 + 10         # 207,498
        self.assertEqual(flops.forward_flops_per_image(model),
                         conv1 + pool1 + conv2 + pool2 + dense)
        self.assertEqual(flops.training_flops_per_image(model),
                         3 * flops.forward_flops_per_image(model))

    @parameterized.parameters("lenet", "resnet18")
    def test_agrees_with_tensorflows_profiler(self, name):
        model = models.build(name, num_classes=10, input_shape=(28, 28, 1))
        # The profiler counts convolutions, matmuls and bias adds; the element-wise layers the
        # analytic count adds are under 2% of the total.
        self.assertAllClose(flops.forward_flops_per_image(model),
                            profiler_forward_flops(model, (28, 28, 1)), rtol=0.02)


if __name__ == "__main__":
    tf.test.main()
