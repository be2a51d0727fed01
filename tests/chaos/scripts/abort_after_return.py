"""A plain torch script (no elastic_rt import) that trains a few all-reduce steps, prints done, and then dies in
interpreter teardown on the ranks given: --abort-at-exit aborts from an atexit handler (after the script has
returned, as torch 2.13 sometimes does on its own); --abort-before-return aborts before returning."""

import argparse
import atexit
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--abort-at-exit", type=int, nargs="*", default=[])
p.add_argument("--abort-before-return", type=int, nargs="*", default=[])
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(5):
    dist.all_reduce(t)
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
print(f"done rank={rank} restart={restart} world_size={dist.get_world_size()}", flush=True)
dist.destroy_process_group()
if rank in a.abort_at_exit:
    atexit.register(os.abort)
if rank in a.abort_before_return:
    os.abort()
