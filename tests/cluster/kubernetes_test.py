"""Tests of the cluster of a Kubernetes Indexed Job's pods behind a headless Service."""

import os
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import kubernetes
from tfpar.cluster import spec as cluster
from tfpar.errors import ClusterError

POD = {"JOB_COMPLETION_INDEX": "1", "TFPAR_NUM_WORKERS": "3", "TFPAR_SERVICE": "tfpar-workers"}


class KubernetesTest(tf.test.TestCase, parameterized.TestCase):

    def test_a_pod_of_an_indexed_job(self):
        self.assertEqual(kubernetes.cluster_spec(POD, "tfpar-train-1"),
                         ({"worker": ["tfpar-train-0.tfpar-workers:2222",
                                      "tfpar-train-1.tfpar-workers:2222",
                                      "tfpar-train-2.tfpar-workers:2222"]}, "worker", 1))

    def test_the_port_and_a_fully_qualified_hostname(self):
        spec = kubernetes.cluster_spec({**POD, "TFPAR_PORT": "9000"},
                                       "job-7-1.tfpar-workers.default.svc.cluster.local")
        self.assertEqual(spec[0]["worker"][0], "job-7-0.tfpar-workers:9000")

    def test_auto_finds_it_in_a_pod(self):
        with mock.patch.dict(os.environ, POD, clear=True), \
                mock.patch("socket.gethostname", return_value="tfpar-train-1"):
            resolver = cluster.resolver("auto")
        self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 1))
        self.assertEqual(resolver.cluster_spec().as_dict()["worker"][2],
                         "tfpar-train-2.tfpar-workers:2222")
        with mock.patch.dict(os.environ, {"JOB_COMPLETION_INDEX": "0"}, clear=True):
            self.assertIsNone(cluster.resolver("auto"))  # Any Indexed Job is not a tfpar job.

    @parameterized.named_parameters(
        ("no_service", {**POD, "TFPAR_SERVICE": ""}, "tfpar-train-1",
         r"needs TFPAR_SERVICE, the headless Service"),
        ("no_count", {**POD, "TFPAR_NUM_WORKERS": "two"}, "tfpar-train-1",
         r"TFPAR_NUM_WORKERS must be a whole number of at least 1\. Received: 'two'"),
        ("no_index", {**POD, "JOB_COMPLETION_INDEX": ""}, "tfpar-train-1",
         r"needs JOB_COMPLETION_INDEX, which Kubernetes sets.*completionMode: Indexed"),
        ("index_out_of_range", {**POD, "JOB_COMPLETION_INDEX": "3"}, "tfpar-train-3",
         r"JOB_COMPLETION_INDEX must be a whole number from 0 to 2\. Received: '3'"),
        ("bad_port", {**POD, "TFPAR_PORT": "70000"}, "tfpar-train-1",
         r"TFPAR_PORT must be a whole number from 1 to 65535"),
        ("hostname_set", POD, "trainer",
         r"hostname <job name>-<index>; this one is 'trainer'.*Set subdomain"))
    def test_what_is_wrong_is_named(self, environ, hostname, message):
        with self.assertRaisesRegex(ClusterError, message):
            kubernetes.cluster_spec(environ, hostname)
