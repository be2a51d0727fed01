"""Config sections: a feature's frozen settings whose fields declare their `launch` flags (name, default, meaning,
parser); the command line, the README's flags table and the agent's configuration collect them generically."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from elastic_rt.errors import ConfigError

S = TypeVar("S")


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One `launch` flag that sets one section field: its spellings, what argparse holds before it is given
    (`default`, as a user would type it), its meaning (the README's flags table), and `parse`, which turns what
    argparse holds into the field's value or raises ConfigError in one line naming the flag."""

    names: tuple[str, ...]
    help: str
    default: Any
    parse: Callable[[Any], Any] | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    action: str | None = None

    @property
    def dest(self) -> str:
        """argparse's attribute name: the first spelling without its dashes (`--hang-timeout` -> hang_timeout)."""
        return self.names[0].lstrip("-").replace("-", "_")

    def value(self, raw: Any) -> Any:
        return self.parse(raw) if self.parse is not None else raw


def option(*names: str, help: str, default: Any, parse: Callable[[Any], Any] | None = None,
           type: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
           action: str | None = None) -> Any:
    """A section field set by a flag. The field's default is what the flag's default parses to, so a section
    built in code (`StragglerSettings()`) and one built from an empty command line are equal."""
    flag = Flag(names=names, help=help, default=default, parse=parse, type=type, choices=choices, action=action)
    return dataclasses.field(default=flag.value(default), metadata={"flag": flag})


def flags(section: type) -> list[tuple[str, Flag]]:
    """(field name, flag) for each field of `section` that a flag sets, in declaration order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(section) if "flag" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser, section: type) -> None:
    """Add the section's flags to `parser`."""
    for _, flag in flags(section):
        kwargs: dict[str, Any] = {"default": flag.default, "help": flag.help}
        if flag.type is not None:
            kwargs["type"] = flag.type
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        if flag.action is not None:
            kwargs["action"] = flag.action
        parser.add_argument(*flag.names, **kwargs)


def from_args(section: type[S], args: argparse.Namespace) -> S:
    """The section as the parsed flags set it; raises ConfigError for a value its flag refuses."""
    return section(**{name: flag.value(getattr(args, flag.dest)) for name, flag in flags(section)})


def pick(sections: tuple[object, ...], kind: type[S]) -> S:
    """The section of type `kind` among `sections`, or its defaults when none was given."""
    for section in sections:
        if type(section) is kind:
            return section  # type: ignore[return-value]
    return kind()


# ---- parsers that flags share --------------------------------------------------------------------------
def positive(flag: str, *, zero_ok: bool = False) -> Callable[[float], float]:
    """A number > 0 (>= 0 with zero_ok), refused in one line naming `flag`."""

    def check(value: float) -> float:
        if value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"{flag} {value:g}: must be {'>= 0' if zero_ok else '> 0'}")
        return value

    return check


def on_off(value: str) -> bool:
    """`on` -> True, `off` -> False (argparse's choices refuse anything else)."""
    return value == "on"
