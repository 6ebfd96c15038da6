"""Tests of the model builders: exact parameter counts, shapes, names, argument errors."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import models
from tfpar.errors import RegistryError


class LeNetTest(tf.test.TestCase):

    def test_parameter_count_matches_the_seeds(self):
        model = models.lenet()
        # conv1 3*3*1*20+20 = 200; conv2 5*5*20*50+50 = 25,050; 28 -> 26 -> 13 -> 9 -> 4, so
        # flatten 4*4*50 = 800; dense1 800*128+128 = 102,528; logits 128*10+10 = 1,290.
        self.assertEqual(model.count_params(), 129_068)

    def test_layers_and_output(self):
        model = models.lenet()
        self.assertEqual([layer.name for layer in model.layers],
                         ["lenet_input", "lenet_conv1", "lenet_pool1", "lenet_conv2",
                          "lenet_pool2", "lenet_flatten", "lenet_dense1", "lenet_logits"])
        self.assertEqual(model(np.zeros((2, 28, 28, 1), np.float32)).shape, (2, 10))
        self.assertIs(model.get_layer("lenet_logits").activation, keras.activations.linear)

    def test_other_input_shapes(self):
        model = models.lenet(num_classes=5, input_shape=(32, 32, 3))
        self.assertEqual(model(np.zeros((1, 32, 32, 3), np.float32)).shape, (1, 5))

    def test_rejects_too_small_input(self):
        with self.assertRaisesRegex(ValueError, r"height and width >= 18\. Received: "
                                                r"input_shape=\(8, 8, 1\)"):
            models.lenet(input_shape=(8, 8, 1))


class ResNet18Test(tf.test.TestCase, parameterized.TestCase):

    def test_parameter_count(self):
        model = models.resnet18()
        # stem conv 3*3*1*64+64 = 640, BN 4*64 = 256 (gamma, beta, moving mean, variance);
        # stage1: 2 blocks * (2 convs * 36,928 + 2 BN * 256) = 148,736;
        # stage2: (73,856 + 147,584 + 1,024 + 1x1 shortcut 8,320) + (2 * 147,584 + 1,024) = 526,976;
        # stage3: (295,168 + 590,080 + 2,048 + 33,024) + (2 * 590,080 + 2,048) = 2,102,528;
        # stage4: (1,180,160 + 2,359,808 + 4,096 + 131,584) + (2 * 2,359,808 + 4,096) = 8,399,360;
        # logits 512*10+10 = 5,130. Total 11,183,626.
        self.assertEqual(model.count_params(), 11_183_626)

    @parameterized.parameters(((28, 28, 1), 10), ((32, 32, 3), 100))
    def test_output_shape(self, input_shape, num_classes):
        model = models.resnet18(num_classes=num_classes, input_shape=input_shape)
        out = model(np.zeros((2, *input_shape), np.float32), training=False)
        self.assertEqual(out.shape, (2, num_classes))

    def test_hierarchical_names_and_no_max_pool(self):
        names = [layer.name for layer in models.resnet18().layers]
        self.assertEqual(names[:4], ["resnet18_input", "resnet18_stem_conv", "resnet18_stem_bn",
                                     "resnet18_stem_relu"])
        self.assertIn("resnet18_stage2_block1_shortcut", names)
        self.assertNotIn("resnet18_stage1_block1_shortcut", names)
        self.assertFalse(any("max" in n for n in names))
        self.assertEqual(names[-2:], ["resnet18_avg_pool", "resnet18_logits"])

    def test_downsampling(self):
        model = models.resnet18()
        # Stride 1 stem keeps 28x28; stages 2-4 halve it: 14, 7, 4.
        self.assertEqual(model.get_layer("resnet18_stage1_block2_out").output.shape[1], 28)
        self.assertEqual(model.get_layer("resnet18_stage4_block2_out").output.shape[1:],
                         (4, 4, 512))

    def test_synchronized_batchnorm_option(self):
        model = models.resnet18(synchronized_batchnorm=True)
        self.assertTrue(model.get_layer("resnet18_stem_bn").synchronized)


class BuildTest(tf.test.TestCase):

    def test_build_by_name(self):
        self.assertEqual(models.build("lenet", num_classes=10, input_shape=(28, 28, 1)).name,
                         "lenet")

    def test_unknown_name_lists_available(self):
        with self.assertRaisesRegex(RegistryError,
                                    r"Unknown model 'vgg'\. Available models: lenet, resnet18\."):
            models.build("vgg", num_classes=10, input_shape=(28, 28, 1))

    def test_options_of_each_builder(self):
        self.assertEqual(models.options("lenet"), [])
        self.assertIn("synchronized_batchnorm", models.options("resnet18"))

    def test_an_option_the_builder_does_not_take(self):
        with self.assertRaisesRegex(RegistryError, r"Model 'lenet' does not take "
                                                   r"synchronized_batchnorm\. Its options: none"):
            models.build("lenet", num_classes=10, input_shape=(28, 28, 1),
                         synchronized_batchnorm=True)

    def test_bad_num_classes(self):
        with self.assertRaisesRegex(ValueError, r"num_classes must be an integer >= 2\. "
                                                r"Received: num_classes=1\."):
            models.lenet(num_classes=1)


if __name__ == "__main__":
    tf.test.main()
