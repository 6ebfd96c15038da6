"""Tests of reading a lost peer from TensorFlow's error text."""

import unittest

from tfpar.cluster import failures

# What worker 0 of two raised when worker 1 was killed inside a step (TensorFlow 2.21):
# its own devices are named too.
RESET = ("Graph execution error:\n\nDetected at node CollectiveReduceV2 ...\nAborting "
         "RingReduce with UNAVAILABLE: recvmsg:Connection reset by peer\nAdditional GRPC error "
         "information from remote target /job:worker/replica:0/task:1 while calling "
         "/tensorflow.WorkerService/RecvBuf:\n:UNKNOWN:Error received from peer\n\t [[{{node "
         "CollectiveReduceV2}}]] [Op:__inference_multi_step_on_iterator_3] on "
         "/job:worker/replica:0/task:0/device:CPU:0")


class LostPeersTest(unittest.TestCase):

    def test_a_reset_connection_names_the_remote_peer_not_the_reporter(self):
        self.assertEqual(failures.lost_peers(RESET), ["worker 1"])

    def test_unhealthy_tasks_are_those_the_coordination_service_lists(self):
        message = ("/job:worker/replica:0/task:0/device:CPU:0: The following tasks are "
                   "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n")
        self.assertEqual(failures.lost_peers(message), ["worker 2"])

    def test_other_errors_are_no_lost_peer(self):
        self.assertIsNone(failures.lost_peers("Incompatible shapes: [2] vs. [3]"))


if __name__ == "__main__":
    unittest.main()
