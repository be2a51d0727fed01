"""User state for a save or load: per-rank vs global parts, snapshots, optimizer storages, RNG."""

from __future__ import annotations

import copy
import io
import pickle
import random
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

from elastic_rt.checkpoint.trust import refused_type
from elastic_rt.errors import CheckpointError


def split_state(
    state: Mapping[str, Any], per_rank_keys: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global part, per-rank part) of the top-level state mapping."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of name -> state, got {type(state).__name__}")
    keys = set(per_rank_keys)
    for key in state:
        if not isinstance(key, str):
            raise CheckpointError(f"state keys must be strings, got {key!r}")
    global_part = {k: v for k, v in state.items() if k not in keys}
    per_rank = {k: v for k, v in state.items() if k in keys}
    return global_part, per_rank


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (torch.Tensor, Mapping))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def snapshot(obj: Any, *, keep_live: Callable[[torch.Tensor], bool]) -> Any:
    """A copy of a nested state that later training cannot change: containers rebuilt,
    non-tensor leaves deep-copied, tensors cloned unless keep_live(tensor) (then they are
    referenced, and the caller guarantees they stay unchanged until staged or written).
    Objects with state_dict()/load_state_dict() are replaced by their state_dict()."""
    if is_stateful(obj):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        return obj.detach() if keep_live(obj) else obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: snapshot(v, keep_live=keep_live) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v, keep_live=keep_live) for v in obj]
    return copy.deepcopy(obj)


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the memory a tensor (or a DTensor's local shard) lives in."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def optimizer_storage_ptrs(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storages only optimizer.step() changes: the parameters and the optimizer's own state."""
    ptrs = set()
    for optim in optimizers:
        for group in optim.param_groups:
            for param in group["params"]:
                ptrs.add(storage_ptr(param))
        for per_param in optim.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    ptrs.add(storage_ptr(value))
    return ptrs


def encode_per_rank(per_rank: Mapping[str, Any]) -> bytes:
    """Serialize one rank's private state (RNG states: tensors, ints, tuples) with torch.save."""
    buffer = io.BytesIO()
    torch.save(dict(per_rank), buffer)
    return buffer.getvalue()


def decode_per_rank(data: bytes) -> dict[str, Any]:
    """Inverse of encode_per_rank; weights_only, so storage cannot run code on load."""
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused_type("this rank's per-rank state", exc) from exc
    except Exception as exc:  # torch raises several types for bad data
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"per-rank state is unreadable ({type(exc).__name__}: {first})") from exc
    if not isinstance(loaded, dict):
        raise CheckpointError("per-rank state is not a dict")
    return loaded


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (python, torch CPU, CUDA when present), for state["rng"]."""
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(rng: Mapping[str, Any]) -> None:
    """Inverse of capture_rng_state; keys that are absent are left alone."""
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
