"""Loading the newest checkpoint that verifies: candidates, distributed checks, fallback, DCP load."""

from __future__ import annotations

import logging
from typing import Any, MutableMapping

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.collectives import CheckpointGroups
from elastic_rt.checkpoint.manifest import Manifest
from elastic_rt.checkpoint.options import CheckpointOptions
from elastic_rt.checkpoint.saver import describe_error
from elastic_rt.checkpoint.user_state import decode_per_rank, split_state
from elastic_rt.checkpoint.storage import CheckpointStore, rank_filename
from elastic_rt.checkpoint.writer import FsspecCheckpointReader
from elastic_rt.errors import CheckpointError, ElasticRTError

log = logging.getLogger(__name__)


def load_latest(
    state: MutableMapping[str, Any], *, store: CheckpointStore, groups: CheckpointGroups, options: CheckpointOptions
) -> int | None:
    """Every rank: load the newest committed checkpoint whose files match its manifest into
    state; a damaged one is skipped with a warning naming the file and the reason. Each rank
    checksums 1/world of the files. None when nothing was ever committed; CheckpointError
    when checkpoints exist but none verifies (starting over silently would lose the run)."""
    candidates: Any = None
    if groups.rank == 0:
        try:
            candidates = [(e.step, e.manifest) for e in reversed(store.list()) if e.committed]
        except ElasticRTError as exc:
            candidates = str(exc)
    candidates = coll.broadcast(candidates, groups.ctl)
    if isinstance(candidates, str):
        raise CheckpointError(candidates)
    failures = []
    for i, (step, manifest) in enumerate(candidates):
        step_dir = store.step_dir(step)
        problems = []
        if options.verify_on_load:
            mine = [f for j, f in enumerate(manifest.files) if j % groups.world_size == groups.rank]
            problems = store.verify_files(step_dir, mine)
        problems = sorted(p for per_rank in coll.all_gather(problems, groups.ctl) for p in per_rank)
        if problems:
            following = f"step {candidates[i + 1][0]}" if i + 1 < len(candidates) else "nothing"
            failures.append(f"step {step}: {problems[0]}")
            if groups.rank == 0:
                log.warning(
                    "checkpoint step %d under %s is corrupt (%s); falling back to %s",
                    step, store.url, "; ".join(problems), following,
                )
            continue
        _load_step(step, step_dir, manifest, state, store=store, groups=groups, options=options)
        return step
    if failures:
        raise CheckpointError(
            f"none of the {len(failures)} committed checkpoints under {store.url} verifies "
            f"({'; '.join(failures)}); move them aside to start from scratch"
        )
    return None


def _load_step(
    step: int,
    step_dir: str,
    manifest: Manifest,
    state: MutableMapping[str, Any],
    *,
    store: CheckpointStore,
    groups: CheckpointGroups,
    options: CheckpointOptions,
) -> None:
    global_part, per_rank = split_state(state, options.per_rank_keys)
    reader = FsspecCheckpointReader(store.fs, step_dir)
    try:
        dcp.load(global_part, storage_reader=reader, process_group=groups.io, no_dist=groups.io is None)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"loading step {step} from {store.url} failed ({describe_error(exc)}); "
            "does the state passed to load_latest() have the keys and shapes that were saved?"
        ) from exc
    state.update(global_part)
    wanted = set(per_rank) & set(manifest.per_rank_keys)
    if not wanted:
        return
    name = rank_filename(groups.rank)
    if not any(f.path == name for f in manifest.files):
        log.info(
            "rank %d: step %d was saved at world size %d and has no %s for this rank; keeping current",
            groups.rank, step, manifest.world_size, sorted(wanted),
        )
        return
    loaded = decode_per_rank(store.read_file(step_dir, name))
    for key in wanted & set(loaded):
        state[key] = loaded[key]
