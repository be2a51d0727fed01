"""The elastic, resumable, re-sharding sampler (every sample once per epoch across restarts and resizes) and the fixed global batch plan on top of it."""

from __future__ import annotations

from elastic_rt.data.batch_plan import BatchPlanError, GlobalBatchPlan, MicroBatch, StepLayout
from elastic_rt.data.global_batch import GlobalBatchSampler, Step, derive_seed, sample_generator
from elastic_rt.data.partition import Partition, epoch_order
from elastic_rt.data.sampler import ElasticDistributedSampler
from elastic_rt.data.sampler_state import (
    SamplerConfigError,
    SamplerState,
    SamplerStateError,
    SamplerStateMismatchError,
)

__all__ = [
    "BatchPlanError",
    "ElasticDistributedSampler",
    "GlobalBatchPlan",
    "GlobalBatchSampler",
    "MicroBatch",
    "Partition",
    "SamplerConfigError",
    "SamplerState",
    "SamplerStateError",
    "SamplerStateMismatchError",
    "Step",
    "StepLayout",
    "derive_seed",
    "epoch_order",
    "sample_generator",
]
