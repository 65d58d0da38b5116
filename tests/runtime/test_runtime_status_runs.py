"""GET /status's run list and tree over a shared store (views.status_runs): the runs this runtime
holds, then those read from the store that other runtimes drive or ended, each listed once, and
each in one tree: a held tree keeps the runs of it it links in, the rest hang under their own
parents where those are listed, and a run whose parent is not shown with it heads an entry."""

from __future__ import annotations

from luftpause.runtime.run import Run
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.views import link_among, status_runs


def _run(handle: str, parent: Run | str | None = None, tokens: float = 0.0) -> Run:
    parent_handle = parent.handle if isinstance(parent, Run) else parent
    run = Run(handle=handle, spec=RunSpec(task=handle, model="m", parent=parent_handle), caller="c",
              created_at=0.0, messages=[])  # fmt: skip
    run.counters["promptTokens"] = tokens
    if isinstance(parent, Run):
        run.link_under(parent)
    return run


def _tree(entries: list[dict]) -> dict[str, tuple[str | None, list[str]]]:
    """Every node of the tree by handle: (the entry's parent field where it heads one, its children)."""
    nodes: dict[str, tuple[str | None, list[str]]] = {}
    stack = [(e, True) for e in entries]
    while stack:
        node, heads = stack.pop()
        assert node["handle"] not in nodes, f"{node['handle']} is in the tree twice"
        nodes[node["handle"]] = (node["parent"] if heads else None, [c["handle"] for c in node["children"]])
        stack.extend((c, False) for c in node["children"])
    return nodes


def test_the_runs_of_other_runtimes_are_listed_once_each_in_trees_of_their_own_or_the_held_ones():
    # Held here: a root with a child here, and the child the lease keeper linked in from elsewhere.
    root = _run("root", tokens=100)
    here = _run("here", root, tokens=10)
    linked = _run("linked", root, tokens=20)
    # Read from the store: the same child again (fresh), a tree of its own and a run below a run
    # this runtime never saw.
    fresh_linked = _run("linked", "root", tokens=20)
    other_root = _run("other-root", tokens=1000)
    other_child = _run("other-child", other_root, tokens=300)
    orphan = _run("orphan", "gone", tokens=5)
    runs, tree = status_runs([root, here], [fresh_linked, other_root, other_child, orphan])
    assert [r["handle"] for r in runs] == ["root", "here", "linked", "other-root", "other-child", "orphan"]
    assert _tree(tree) == {
        "root": (None, ["here", "linked"]),
        "here": (None, []),
        "linked": (None, []),
        "other-root": (None, ["other-child"]),
        "other-child": (None, []),
        "orphan": ("gone", []),
    }
    subtree = {r["handle"]: r["subtree"]["promptTokens"] for r in runs}
    assert subtree == {
        "root": 130,
        "here": 10,
        "linked": 20,
        "other-root": 1300,
        "other-child": 300,
        "orphan": 5,
    }
    assert linked.parent is root and root.children == [here, linked], "the held runs are left as they were"


def test_without_runs_elsewhere_the_list_is_the_held_runs():
    root = _run("root")
    child = _run("child", root)
    runs, tree = status_runs([root, child])
    assert [r["handle"] for r in runs] == ["root", "child"]
    assert _tree(tree) == {"root": (None, ["child"]), "child": (None, [])}


def test_runs_read_from_the_store_are_linked_to_their_parents_and_one_naming_itself_stands_alone():
    parent, child, own = (
        _run("parent"),
        _run("child", "parent"),
        _run("own", "own"),
    )  # `own`: a damaged journal
    runs, tree = status_runs([], link_among([parent, child, own]))
    assert [r["handle"] for r in runs] == ["parent", "child", "own"]
    assert _tree(tree) == {"parent": (None, ["child"]), "child": (None, []), "own": ("own", [])}
