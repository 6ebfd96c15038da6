"""Peer: PyTorch, LeNet or the modified ResNet-18 (the d2l variant), data-parallel with
``DistributedDataParallel`` over gloo between CPU processes, or one process.

usage: python torch_ddp.py WORLD_SIZE THREADS_PER_PROCESS lenet|resnet18 GLOBAL_BATCH STEPS
Prints ``img/s X`` for STEPS steps after warm-up. ``DTYPE=bfloat16``:
``torch.autocast("cpu", dtype=torch.bfloat16)``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812 (PyTorch's own spelling)
from torch import nn


class Residual(nn.Module):
    def __init__(self, channels_in: int, channels: int, project: bool = False,
                 strides: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv3 = nn.Conv2d(channels_in, channels, 1, stride=strides) if project else None
        self.bn1, self.bn2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.conv3(x) if self.conv3 is not None else x))


def resnet18() -> nn.Module:
    def stage(channels_in: int, channels: int, first: bool = False) -> list[nn.Module]:
        return [Residual(channels_in, channels, project=True, strides=2) if i == 0 and not first
                else Residual(channels, channels) for i in range(2)]

    return nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         *stage(64, 64, True), *stage(64, 128), *stage(128, 256),
                         *stage(256, 512), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(512, 10))


def lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5),
                         nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128),
                         nn.ReLU(), nn.Linear(128, 10))


def worker(rank: int, world: int, threads: int, model_name: str, batch: int,
           steps: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    net = resnet18() if model_name == "resnet18" else lenet()
    if world > 1:
        net = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.rand(batch // world, 1, 28, 28), torch.randint(0, 10, (batch // world,))
    bf16 = os.environ.get("DTYPE", "float32") == "bfloat16"

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if world > 1:
        dist.barrier()
    if rank == 0:
        print(f"img/s {batch * steps / (time.perf_counter() - start):.2f}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    arguments = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                 int(sys.argv[5]))
    if arguments[0] == 1:
        worker(0, *arguments)
    else:
        mp.spawn(worker, args=arguments, nprocs=arguments[0])
