"""The core's working copy of the state declares the state's fields, for the type checker."""

import ast
from pathlib import Path

from luftpause.scheduler.core import tx
from luftpause.scheduler.core.tx import _Tx
from luftpause.scheduler.state import State


def _spelled(annotation: object) -> str:
    # NamedTuple keeps a postponed annotation as a ForwardRef; a plain class keeps the string.
    return str(getattr(annotation, "__forward_arg__", annotation))


def test_the_working_copy_declares_every_field_of_the_state_with_the_states_type() -> None:
    # Besides the state's fields, a decision's own two: what may be placed, and where.
    own = {"may_place", "entered"}
    declared = {name: _spelled(kind) for name, kind in _Tx.__annotations__.items() if name not in own}
    assert declared == {name: _spelled(State.__annotations__[name]) for name in State._fields}
    assert list(declared) == list(State._fields)


def test_the_working_copy_is_opened_from_every_field_of_the_state_in_order() -> None:
    # `_open_tx` unpacks the state into the working copy's fields by position: a field out of
    # place there would take another's value.
    tree = ast.parse(Path(tx.__file__).read_text())
    opener = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_open_tx")
    (unpacking,) = [
        n for n in opener.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
    ]
    target = unpacking.targets[0]
    assert isinstance(target, ast.Tuple)
    assert [e.attr for e in target.elts if isinstance(e, ast.Attribute)] == list(State._fields)
