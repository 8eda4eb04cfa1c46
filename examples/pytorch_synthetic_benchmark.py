"""Synthetic-data training throughput with Horovod's API (ported from ``horovod.torch`` by its import).

    mpiexec -n 2 python examples/pytorch_synthetic_benchmark.py --num-iters 3
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import optim

import tunelab.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size")
parser.add_argument("--image-size", type=int, default=64, help="input image size")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)

model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 1000))
optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Batch size: {args.batch_size}, number of ranks: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)
img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
