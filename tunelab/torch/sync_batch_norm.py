"""``SyncBatchNorm``: batch normalization whose training statistics cover every rank's batch.

In training, the per-channel mean and variance are those of the concatenation of all ranks' batches
(two differentiable Sum allreduces: the sums and counts, then the squared deviations from the global
mean), so outputs, gradients and running statistics equal ``torch.nn.BatchNorm*d`` applied to the
global batch in one process.  In evaluation it uses the running statistics, like any batch norm.
"""

from __future__ import annotations

import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..reduce_ops import Sum
from .ops import allreduce

_MODULE_IDS = itertools.count()


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (input ``[N, C, ...]``) with statistics over all ranks."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input [N, C, ...], got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        c = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, c] + [1] * (input.dim() - 2)
        # One name per module for its statistics' allreduces, the same on every rank that runs the same
        # model (given at its first training forward): per-call names would each be negotiated in full
        # and take a place in the coordinator's cache, about a hundred a step for a ResNet-50
        name = self.__dict__.get("_tl_name")
        if name is None:
            name = self._tl_name = f"syncbn.{next(_MODULE_IDS)}"
        # Statistics in float32 for half-precision input, as torch's batch norms keep them: float16
        # cannot hold a count past 65504 values a channel (32 x 56 x 56 is 100352) nor sums of that many.
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.tensor([x.numel() // max(c, 1)], dtype=x.dtype, device=x.device)
        sums = allreduce(torch.cat([x.sum(dims), count]), op=Sum, name=f"{name}.sum")
        n = sums[c]
        if float(n) <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over all ranks, got {int(n)}")
        mean = sums[:c] / n
        centered = x - mean.reshape(shape)
        sq = allreduce((centered * centered).sum(dims), op=Sum, name=f"{name}.var")
        var = sq / n
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * (n.detach() / (n.detach() - 1)))
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.to(out.dtype).reshape(shape) + self.bias.to(out.dtype).reshape(shape)
        return out.to(input.dtype)

    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased_var.to(self.running_var.dtype), alpha=m)
