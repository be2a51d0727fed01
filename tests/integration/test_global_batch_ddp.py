"""DDP on gloo under the fixed global batch: unequal micro-batch counts, a zero-weight padding rank, buffers.

Three real ranks, B = 7, b = 2: ranks hold 3, 2, 2 samples per step, so rank 0 runs two
micro-batches (the first under no_sync, the second short) and the others one; the epoch's last
step has 2 samples, so rank 2 trains one padding sample with loss scale 0. The model has a buffer, so DDP broadcasts
buffers in the forward pass. Each step's all-reduced gradient must be the mean gradient over the
step's samples, computed in one process on the whole batch; the parameters after the epoch must
be that process's, up to float64 reassociation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastic_rt.data import ElasticDistributedSampler, GlobalBatchSampler, epoch_order
from benchmarks.gloo_world import run_world

N, B, MICRO, WORLD, SEED = 16, 7, 2, 3, 5


class Scaled(nn.Module):
    """A small MLP with a buffer (DDP broadcasts it at the first forward of every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.register_buffer("scale", torch.full((6,), 0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.scale)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def fresh_model() -> Scaled:
    torch.manual_seed(0)
    return Scaled().double()


def train_ranks(rank: int, world_size: int) -> dict:
    model = DDP(fresh_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ElasticDistributedSampler(data(), num_replicas=world_size, rank=rank, seed=SEED)
    batches = GlobalBatchSampler(sampler, global_batch_size=B, micro_batch_size=MICRO)
    loader = DataLoader(data(), batch_sampler=batches)
    grads, counts, padding = [], [], []
    for step in batches.steps(loader):
        for micro, (x, y) in step:
            with micro.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                (loss * micro.loss_scale).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        counts.append(len(step.micro_batches))
        padding.append(any(m.padding for m in step.micro_batches))
        opt.step()
        opt.zero_grad()
        step.commit()
    dist.barrier()
    return {
        "grads": grads, "counts": counts, "padding": padding, "consumed": sampler.consumed,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= 1e-12 * max(float(want.abs().max()), 1e-300)


def test_all_reduced_gradient_is_the_mean_over_the_step_with_unequal_micro_batches() -> None:
    ranks = run_world(train_ranks, WORLD)
    assert [r["counts"] for r in ranks] == [[2, 2, 1], [1, 1, 1], [1, 1, 1]]
    assert [r["padding"] for r in ranks] == [[False] * 3] * 2 + [[False, False, True]]
    assert {r["consumed"] for r in ranks} == {N}

    # The reference: one process, the whole step's samples in one batch, plain mean loss.
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = epoch_order(dataset_length=N, seed=SEED, epoch=0, shuffle=True)
    x, y = data().tensors
    for k, start in enumerate(range(0, N, B)):
        idx = order[start:start + B]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        for r in ranks:
            for got, p in zip(r["grads"][k], model.parameters()):
                assert close(got, p.grad), f"step {k}: all-reduced gradient is not the mean over the step"
        opt.step()
    for r in ranks:
        for got, p in zip(r["params"], model.parameters()):
            assert close(got, p.detach())
