"""README's flags tables match the argument parser and the --rdzv-conf keys registration reads.

When a flag, a default or a --rdzv-conf key changes, regenerate README's section with
    python -m tests.support.cli_docs --write README.md
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.support import cli_docs

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "run `python -m tests.support.cli_docs --write README.md`"


def table_rows(section: str) -> dict[str, str]:
    """First cell -> second cell (flag or key -> default) of every table row in the section."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) >= 2 and not set(cells[0]) <= set("-") and cells[0] not in ("flag", "`--rdzv-conf` key"):
            rows[cells[0]] = cells[1]
    return rows


def test_readme_flags_section_is_what_the_parser_generates():
    readme = (REPO / "README.md").read_text()
    current = cli_docs.section(readme)
    assert current is not None, f"README.md has no generated flags section; {REGENERATE}"
    wanted = cli_docs.render()
    have, want = table_rows(current), table_rows(wanted)
    assert sorted(set(want) - set(have)) == [], f"flags or keys missing from README; {REGENERATE}"
    assert sorted(set(have) - set(want)) == [], f"README lists flags or keys that do not exist; {REGENERATE}"
    changed = {name: (have[name], want[name]) for name in want if have[name] != want[name]}
    assert changed == {}, f"defaults differ (README, parser); {REGENERATE}"
    assert current == wanted, f"README's flag meanings differ from the parser's help; {REGENERATE}"


def test_every_launch_flag_is_in_the_table():
    _, launch = cli_docs._parsers()
    table = cli_docs.flags_table()
    for action in launch._actions:
        if action.option_strings and action.dest != "help":
            assert f"`{action.option_strings[0]}`" in table, action.option_strings


def test_every_rdzv_conf_key_registration_reads_is_documented():
    from elastic_rt.rendezvous import conf as rdzv_conf
    from elastic_rt.rendezvous import registration

    source = inspect.getsource(registration)
    read = (set(re.findall(r"(?:params|conf)\.get\(\s*\"(\w+)\"", source))
            | set(re.findall(r"conf\[\"(\w+)\"\]", source))
            | set(re.findall(r"_float\(\s*params,\s*\"(\w+)\"", source))
            | set(re.findall(r"flag\(\s*conf,\s*\"(\w+)\"", source))) - {"fingerprint"}  # set by launch itself
    documented = {name for k in rdzv_conf.KEYS for name in (k.key, *k.aliases)}
    assert read, "found no --rdzv-conf keys in rendezvous/registration.py; update this test's patterns"
    assert sorted(read - documented) == [], f"add them to elastic_rt/rendezvous/conf.py KEYS; {REGENERATE}"


@pytest.mark.parametrize("key", ["lease_ttl", "join_timeout", "last_call_timeout", "store_timeout", "read_timeout"])
def test_each_documented_timeout_key_sets_its_setting(key):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_rt.rendezvous.registration import etcd_config_from_params, settings_from_params

    from elastic_rt.rendezvous.conf import KEYS

    field = next(k.field for k in KEYS if k.key == key)
    params = RendezvousParameters(backend="etcd-v3", endpoint="localhost:2379", run_id="docs", min_nodes=1,
                                  max_nodes=1, local_addr="localhost", **{key: "7.5"})
    built = {**vars(etcd_config_from_params(params, "node-a")), **vars(settings_from_params(params))}
    assert built[field] == 7.5
    assert cli_docs.rdzv_conf_defaults()[key] != 7.5
