"""The sampler's checkpoint state: its plain-data format, its validation and its errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from elastic_rt.errors import CheckpointError, ConfigError

STATE_VERSION = 1

_INT_KEYS = ("version", "epoch", "seed", "consumed", "dataset_length")
_BOOL_KEYS = ("shuffle", "drop_last")
STATE_KEYS = frozenset(_INT_KEYS + _BOOL_KEYS)


class SamplerConfigError(ConfigError, ValueError):
    """An argument given to the sampler, or a call made on it, is invalid."""


class SamplerStateError(CheckpointError, ValueError):
    """A sampler state dict is malformed: not something ElasticDistributedSampler wrote."""


class SamplerStateMismatchError(SamplerStateError):
    """A well-formed sampler state was saved for another dataset length, seed or mode."""


def is_int(value: object) -> bool:
    """An int that is not a bool (True would pass isinstance(value, int))."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SamplerState:
    """Progress through one epoch's global order; independent of the world size."""

    epoch: int
    seed: int
    consumed: int
    dataset_length: int
    shuffle: bool
    drop_last: bool

    def to_dict(self) -> dict[str, int | bool]:
        """Plain data (ints and bools only), safe for JSON, torch.save and DCP."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self.consumed,
            "dataset_length": self.dataset_length,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    @classmethod
    def from_dict(cls, data: object) -> "SamplerState":
        """Validate what ``to_dict`` wrote; raise SamplerStateError on anything else."""
        if not isinstance(data, Mapping):
            raise SamplerStateError(
                f"sampler state must be a dict as returned by state_dict(), got {type(data).__name__}"
            )
        keys = set(data.keys())
        missing = sorted(STATE_KEYS - keys)
        if missing:
            raise SamplerStateError(
                f"sampler state is missing {', '.join(missing)}; "
                "pass the dict returned by ElasticDistributedSampler.state_dict()"
            )
        unknown = sorted(str(k) for k in keys - STATE_KEYS)
        if unknown:
            raise SamplerStateError(
                f"sampler state has unknown key(s) {', '.join(unknown)}; "
                "pass the dict returned by ElasticDistributedSampler.state_dict()"
            )
        for key in _INT_KEYS:
            if not is_int(data[key]):
                raise SamplerStateError(
                    f"sampler state {key!r} must be an int, got {type(data[key]).__name__} "
                    f"{data[key]!r}"
                )
        for key in _BOOL_KEYS:
            if not isinstance(data[key], bool):
                raise SamplerStateError(
                    f"sampler state {key!r} must be a bool, got {type(data[key]).__name__} "
                    f"{data[key]!r}"
                )
        if data["version"] != STATE_VERSION:
            raise SamplerStateError(
                f"sampler state version {data['version']} is not supported "
                f"(this elastic-rt reads version {STATE_VERSION})"
            )
        if data["dataset_length"] < 0:
            raise SamplerStateError(
                f"sampler state dataset_length must be >= 0, got {data['dataset_length']}"
            )
        if not 0 <= data["consumed"] <= data["dataset_length"]:
            raise SamplerStateError(
                f"sampler state consumed must be between 0 and dataset_length "
                f"({data['dataset_length']}), got {data['consumed']}"
            )
        return cls(
            epoch=data["epoch"],
            seed=data["seed"],
            consumed=data["consumed"],
            dataset_length=data["dataset_length"],
            shuffle=data["shuffle"],
            drop_last=data["drop_last"],
        )

    def check_compatible(
        self, *, dataset_length: int, seed: int, shuffle: bool, drop_last: bool
    ) -> None:
        """Refuse a state whose global order or tail rule differs from this sampler's."""
        mismatches = []
        for name, saved, current in (
            ("dataset length", self.dataset_length, dataset_length),
            ("seed", self.seed, seed),
            ("shuffle", self.shuffle, shuffle),
            ("drop_last", self.drop_last, drop_last),
        ):
            if saved != current:
                mismatches.append(f"{name} {saved} in the state but {current} in this sampler")
        if mismatches:
            raise SamplerStateMismatchError(
                "sampler state was saved for another data order ("
                + "; ".join(mismatches)
                + "); restore it into a sampler built on the same dataset with the same "
                "seed, shuffle and drop_last, or start the epoch afresh without it"
            )

