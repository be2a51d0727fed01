"""The elastic, resumable, re-sharding sampler: every sample once per epoch across restarts and resizes."""

from __future__ import annotations

from elastic_rt.data.partition import Partition, epoch_order
from elastic_rt.data.sampler import ElasticDistributedSampler
from elastic_rt.data.sampler_state import (
    SamplerConfigError,
    SamplerState,
    SamplerStateError,
    SamplerStateMismatchError,
)

__all__ = [
    "ElasticDistributedSampler",
    "Partition",
    "SamplerConfigError",
    "SamplerState",
    "SamplerStateError",
    "SamplerStateMismatchError",
    "epoch_order",
]
