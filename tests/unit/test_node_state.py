"""NodeState.evolve (decide.py): the copy a round makes of a node's state at each step, as dataclasses.replace makes
it, without replace()'s cost."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_rt.rendezvous.decide import NodeState


def _node() -> NodeState:
    return NodeState(node_id="n1", min_nodes=2, max_nodes=4, last_call_timeout_s=30.0, deadline=100.0)


@pytest.mark.parametrize("changes", [{}, {"joined": 3}, {"joined": 3, "joined_with": 7, "read_due": 5.0},
                                     {"read": {"n2": None}, "fresh_read": True}, {"node_id": "n9", "written": None}])
def test_evolve_is_replace(changes):
    node = _node()
    new = node.evolve(**changes)
    assert new == dataclasses.replace(node, **changes) and type(new) is NodeState
    assert node == _node()  # the original is unchanged
    assert new is not node


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError, match="no field jonied"):
        _node().evolve(jonied=3)


def test_the_copy_is_frozen_and_has_every_field():
    new = _node().evolve(joined=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.joined = 4
    assert {f.name for f in dataclasses.fields(NodeState)} == set(vars(new))
    assert new.fallback_s == 30.0 and new.between_rounds().joined is None


def test_there_is_no_post_init_for_evolve_to_skip():
    """evolve() copies the instance dict; a __post_init__ added to NodeState would have to run there too."""
    assert not hasattr(NodeState, "__post_init__")
