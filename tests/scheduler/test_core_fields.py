"""The core's working copy of the state declares the state's fields, for the type checker."""

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
