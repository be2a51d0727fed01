"""Loading the newest checkpoint that verifies: candidates, distributed checks, fallback, DCP load."""

from __future__ import annotations

import logging
from typing import Any, MutableMapping

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.checked_read import verified_while_loading
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
    state; a damaged one is skipped with a warning naming the file and the reason. Small files
    (.metadata, per-rank files) are checked before anything reads them, each rank 1/world of
    them; DCP's data files are checked by the load's own read (checkpoint/checked_read.py), and
    a step whose files do not match is loaded no further: the previous one is loaded again in
    full (the bad one may have written into the state's tensors). None when nothing was ever
    committed; CheckpointError when checkpoints exist but none verifies (starting over silently
    would lose the run; the state's tensors may then hold partly loaded values)."""
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
        problems = _check_before_load(step_dir, manifest, store=store, groups=groups, options=options)
        if not problems:
            problems = _load_step(step, step_dir, manifest, state, store=store, groups=groups, options=options)
            if not problems:
                return step
        following = f"step {candidates[i + 1][0]}" if i + 1 < len(candidates) else "nothing"
        failures.append(f"step {step}: {problems[0]}")
        if groups.rank == 0:
            log.warning(
                "checkpoint step %d under %s is corrupt (%s); falling back to %s",
                step, store.url, "; ".join(problems), following,
            )
    if failures:
        raise CheckpointError(
            f"none of the {len(failures)} committed checkpoints under {store.url} verifies "
            f"({'; '.join(failures)}); move them aside to start from scratch"
        )
    return None


def _everyone(problems: list[str], groups: CheckpointGroups) -> list[str]:
    return sorted(p for per_rank in coll.all_gather(problems, groups.ctl) for p in per_rank)


def _check_before_load(
    step_dir: str, manifest: Manifest, *, store: CheckpointStore, groups: CheckpointGroups, options: CheckpointOptions
) -> list[str]:
    """Every rank (collective): sizes of 1/world of the files, and the crc32 of those among them that
    the load's own read does not check. The problems of all ranks, so that all decide alike."""
    problems: list[str] = []
    if options.verify_on_load:
        mine = [f for j, f in enumerate(manifest.files) if j % groups.world_size == groups.rank]
        problems = store.verify_files(step_dir, [f for f in mine if not verified_while_loading(f.path)])
        problems += store.check_sizes(step_dir, [f for f in mine if verified_while_loading(f.path)])
    return _everyone(problems, groups)


def _check_after_load(
    reader: FsspecCheckpointReader, step_dir: str, manifest: Manifest, *, store: CheckpointStore,
    groups: CheckpointGroups,
) -> list[str]:
    """Every rank (collective): what the load's reads found, and the crc32 of data files no rank read
    (no state came from them, but a checkpoint that loads has every file intact)."""
    gathered = coll.all_gather((reader.problems, sorted(reader.files_read)), groups.ctl)
    problems = sorted(p for found, _ in gathered for p in found)
    read = {name for _, names in gathered for name in names}
    unread = [f for f in manifest.files if verified_while_loading(f.path) and f.path not in read]
    if unread:  # the same list on every rank
        mine = [f for j, f in enumerate(unread) if j % groups.world_size == groups.rank]
        problems += _everyone(store.verify_files(step_dir, mine), groups)
    return problems


def _load_step(
    step: int,
    step_dir: str,
    manifest: Manifest,
    state: MutableMapping[str, Any],
    *,
    store: CheckpointStore,
    groups: CheckpointGroups,
    options: CheckpointOptions,
) -> list[str]:
    """Load one step into `state`; the problems its data files showed (then `state` must not be used)."""
    global_part, per_rank = split_state(state, options.per_rank_keys)
    expected = {f.path: f for f in manifest.files if verified_while_loading(f.path)} if options.verify_on_load \
        else None
    reader = FsspecCheckpointReader(store.fs, step_dir, expected=expected)
    try:
        dcp.load(global_part, storage_reader=reader, process_group=groups.io, no_dist=groups.io is None)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"loading step {step} from {store.url} failed ({describe_error(exc)}); "
            "does the state passed to load_latest() have the keys and shapes that were saved?"
        ) from exc
    if expected is not None:
        problems = _check_after_load(reader, step_dir, manifest, store=store, groups=groups)
        if problems:
            return problems
    state.update(global_part)
    wanted = set(per_rank) & set(manifest.per_rank_keys)
    if not wanted:
        return []
    name = rank_filename(groups.rank)
    if not any(f.path == name for f in manifest.files):
        log.info(
            "rank %d: step %d was saved at world size %d and has no %s for this rank; keeping current",
            groups.rank, step, manifest.world_size, sorted(wanted),
        )
        return []
    loaded = decode_per_rank(store.read_file(step_dir, name))
    for key in wanted & set(loaded):
        state[key] = loaded[key]
    return []
