"""Config sections: a feature's flags declared once, in its settings dataclass, reach `launch`'s parser, the agent's
config and README's table with no other edit."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from elastic_rt import sections
from elastic_rt.agent.config import AgentConfig
from elastic_rt.cli import build_parser
from elastic_rt.launch_config import SECTIONS, launch_config_from_args
from elastic_rt.errors import ConfigError
from tests.support import cli_docs


def _launch_actions() -> dict[str, argparse.Action]:
    top = build_parser(environ={})
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["launch"]._actions}


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_every_section_flag_is_a_launch_flag_with_its_meaning(section):
    actions = _launch_actions()
    declared = sections.flags(section)
    assert declared, f"{section.__name__} declares no flag"
    for _, flag in declared:
        action = actions[flag.dest]
        assert tuple(action.option_strings) == flag.names and action.help == flag.help and flag.help.strip()


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_an_empty_command_line_gives_each_sections_defaults(section):
    cfg = launch_config_from_args(build_parser(environ={}).parse_args(["launch", "--standalone", "train.py"]))
    assert cfg.section(section) == section()


def test_the_flags_table_lists_every_section_flag():
    table = cli_docs.flags_table()
    for section in SECTIONS:
        for _, flag in sections.flags(section):
            assert f"| `{flag.names[0]}` |" in table


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Gadget:
    """A feature that did not exist: its section is all it takes to have flags."""

    rate_s: float = sections.option("--gadget-rate", type=float, default=2.0, parse=sections.positive("--gadget-rate"),
                                    help="seconds between gadget runs (default 2)")
    mode: str = sections.option("--gadget-mode", default="on", choices=("on", "off"), help="on or off")
    on: bool = sections.option("--gadget", default="off", choices=("on", "off"), parse=sections.on_off, help="x")
    not_a_flag: int = 7


def test_a_new_section_is_parsed_validated_and_found_in_the_agent_config():
    parser = argparse.ArgumentParser()
    sections.add_arguments(parser, _Gadget)
    assert _Gadget() == _Gadget(rate_s=2.0, mode="on", on=False, not_a_flag=7)
    got = sections.from_args(_Gadget, parser.parse_args(["--gadget-rate", "0.5", "--gadget", "on"]))
    assert got == _Gadget(rate_s=0.5, mode="on", on=True)
    with pytest.raises(ConfigError, match=r"^--gadget-rate -1: must be > 0$"):
        sections.from_args(_Gadget, parser.parse_args(["--gadget-rate", "-1"]))
    cfg = AgentConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d", rdzv_endpoint="",
                      rdzv_id="x", sections=(got,))
    assert cfg.section(_Gadget) is got
    assert AgentConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d", rdzv_endpoint="",
                       rdzv_id="x").section(_Gadget) == _Gadget()  # not given: its defaults
