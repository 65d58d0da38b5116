"""The part of PromQL the luftpause dashboard speaks, parsed and evaluated over recorded scrapes.

`luftpause bench dashboard_plot` draws the Grafana dashboard's panels (deploy/grafana/luftpause.json)
from scrapes it recorded itself, without a Prometheus server, by evaluating each panel's own query
here; tests/deploy/test_dashboard.py reads the metric names each query selects from the same
parse. The subset: selectors with label matchers (`=`, `!=`, `=~`, `!~`), `rate` and `increase`
over a range, `histogram_quantile`, the aggregations `sum`, `min`, `max`, `avg` and `count` with
`by` or `without`, `or`, and a comparison with a number as a filter (`x < Inf`). Anything else is
refused with the position it was met at, so a query the dashboard gains beyond the subset fails
the tests rather than being drawn wrong.

The evaluation follows Prometheus where the picture depends on it: a selector keeps the metric's
name and a function or an aggregation drops it; `or` matches label sets without the name; a
counter that goes down restarted from 0; `histogram_quantile` interpolates linearly within the
bucket the rank falls in, answers the highest finite bound for a rank in the `+Inf` bucket and
nothing for a histogram with no observations. One simplification: a rate is the increase between
the first and the last sample in its window over the time between them, not extrapolated to the
window's edges as Prometheus does, which at one scrape a second differs by under a scrape's worth.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

# A series' labels, the metric's name among them as `__name__` (where it is kept).
Labels = frozenset[tuple[str, str]]
# An instant vector: each series' value at one moment.
Vector = dict[Labels, float]
NAME = "__name__"

AGGREGATIONS = ("sum", "min", "max", "avg", "count")
RANGE_FUNCTIONS = ("rate", "increase")
COMPARISONS = ("<", ">", "<=", ">=", "==", "!=")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w:])
    | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w:])|[-+]?(?i:inf|nan)(?![\w:]))
    | (?P<ident>[A-Za-z_:][\w:]*)
    | (?P<op>=~|!~|!=|==|<=|>=|[(){}\[\],=<>])
    )""",
    re.X,
)


class PromQLError(ValueError):
    """A query outside the subset, or not PromQL at all."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    at: int


def tokens(query: str) -> list[Token]:
    out, at = [], 0
    while at < len(query):
        if not query[at:].strip():
            break
        m = _TOKEN.match(query, at)
        if m is None or m.lastgroup is None:
            raise PromQLError(f"cannot read {query[at:].strip()[:20]!r} at {at} in {query!r}")
        out.append(Token(m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup)))
        at = m.end()
    return out


# -- the syntax tree --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    name: str | None
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value)
    range_s: float | None = None


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Aggregation:
    op: str
    expr: Node
    labels: tuple[str, ...] = ()
    without: bool = False


@dataclass(frozen=True)
class Or:
    left: Node
    right: Node


@dataclass(frozen=True)
class Filter:
    expr: Node
    op: str
    value: float


Node = Selector | Number | Call | Aggregation | Or | Filter


def _duration(text: str) -> float:
    return sum(int(n) * _DURATION_UNITS[u] for n, u in re.findall(r"(\d+)(ms|[smhdwy])", text))


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1])


@dataclass
class _Parser:
    query: str
    toks: list[Token]
    i: int = 0

    def peek(self, offset: int = 0) -> Token | None:
        j = self.i + offset
        return self.toks[j] if j < len(self.toks) else None

    def fail(self, wanted: str) -> PromQLError:
        tok = self.peek()
        where = f"{tok.text!r} at {tok.at}" if tok else "the end"
        return PromQLError(f"expected {wanted}, found {where} in {self.query!r}")

    def take(self, text: str | None = None, kind: str | None = None) -> Token:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text) or (kind is not None and tok.kind != kind):
            raise self.fail(repr(text) if text else kind or "more")
        self.i += 1
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.text == text and tok.kind in ("op", "ident")

    def expr(self) -> Node:
        node = self.comparison()
        while self.at("or"):
            self.i += 1
            node = Or(node, self.comparison())
        return node

    def comparison(self) -> Node:
        node = self.atom()
        tok = self.peek()
        if tok is not None and tok.kind == "op" and tok.text in COMPARISONS:
            self.i += 1
            node = Filter(node, tok.text, float(self.take(kind="number").text))
        return node

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels: list[str] = []
        while not self.at(")"):
            labels.append(self.take(kind="ident").text)
            if not self.at(")"):
                self.take(",")
        self.take(")")
        return tuple(labels)

    def atom(self) -> Node:
        tok = self.peek()
        if tok is None:
            raise self.fail("an expression")
        if tok.text == "(" and tok.kind == "op":
            self.i += 1
            node = self.expr()
            self.take(")")
            return node
        if tok.kind == "number":
            self.i += 1
            return Number(float(tok.text))
        if tok.text == "{" and tok.kind == "op":
            return self.selector(None)
        if tok.kind != "ident":
            raise self.fail("an expression")
        self.i += 1
        if tok.text in AGGREGATIONS and (self.at("(") or self.at("by") or self.at("without")):
            return self.aggregation(tok.text)
        if self.at("("):
            return self.call(tok.text)
        return self.selector(tok.text)

    def aggregation(self, op: str) -> Aggregation:
        labels: tuple[str, ...] = ()
        without = False
        if self.at("by") or self.at("without"):
            without = self.take().text == "without"
            labels = self.label_list()
        self.take("(")
        inner = self.expr()
        self.take(")")
        if not labels and (self.at("by") or self.at("without")):
            without = self.take().text == "without"
            labels = self.label_list()
        return Aggregation(op, inner, labels, without)

    def call(self, function: str) -> Call:
        self.take("(")
        args: list[Node] = []
        while not self.at(")"):
            args.append(self.expr())
            if not self.at(")"):
                self.take(",")
        self.take(")")
        if function in RANGE_FUNCTIONS:
            if len(args) != 1 or not isinstance(args[0], Selector) or args[0].range_s is None:
                raise PromQLError(f"{function} takes one range selector (x[1m]) in {self.query!r}")
        elif function == "histogram_quantile":
            if len(args) != 2 or not isinstance(args[0], Number):
                raise PromQLError(f"histogram_quantile takes a number and a vector in {self.query!r}")
        else:
            raise PromQLError(f"function {function!r} is not in the dashboard's subset ({self.query!r})")
        return Call(function, tuple(args))

    def selector(self, name: str | None) -> Selector:
        matchers: list[tuple[str, str, str]] = []
        if self.at("{"):
            self.take("{")
            while not self.at("}"):
                label = self.take(kind="ident").text
                op = self.take(kind="op").text
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"no label matcher {op!r} in {self.query!r}")
                matchers.append((label, op, _unquote(self.take(kind="string").text)))
                if not self.at("}"):
                    self.take(",")
            self.take("}")
        range_s = None
        if self.at("["):
            self.take("[")
            range_s = _duration(self.take(kind="duration").text)
            self.take("]")
        if name is None:
            name = next((v for label, op, v in matchers if label == NAME and op == "="), None)
            matchers = [m for m in matchers if not (m[0] == NAME and m[1] == "=")]
        if name is None:
            raise PromQLError(f"a selector without a metric name in {self.query!r}")
        return Selector(name, tuple(matchers), range_s)


def parse(query: str) -> Node:
    parser = _Parser(query, tokens(query))
    node = parser.expr()
    if parser.peek() is not None:
        raise parser.fail("the end")
    return node


def _walk(node: Node) -> Iterator[Node]:
    yield node
    if isinstance(node, Call):
        for a in node.args:
            yield from _walk(a)
    elif isinstance(node, Aggregation | Filter):
        yield from _walk(node.expr)
    elif isinstance(node, Or):
        yield from _walk(node.left)
        yield from _walk(node.right)


def metric_names(query: str) -> set[str]:
    """The metric names `query` selects, as Prometheus stores them (`x_total`, `x_bucket`): not
    its functions, aggregations, keywords, label names, label values or durations."""
    return {n.name for n in _walk(parse(query)) if isinstance(n, Selector) and n.name}


# -- evaluation over recorded scrapes ---------------------------------------------------------------


@dataclass
class Scrape:
    """Every target's samples at one moment `t` (seconds), by metric name, each series' labels
    (without its name) as Prometheus would store them: the target's `job`, `instance` and the
    scrape config's own labels added."""

    t: float
    by_name: dict[str, dict[Labels, float]] = field(default_factory=dict)

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        self.by_name.setdefault(name, {})[frozenset(labels.items())] = value


def _matches(labels: Labels, matchers: Sequence[tuple[str, str, str]]) -> bool:
    have = dict(labels)
    for label, op, value in matchers:
        got = have.get(label, "")
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
        if op in ("=~", "!~") and (re.fullmatch(value, got) is not None) != (op == "=~"):
            return False
    return True


def _without(labels: Labels, *names: str) -> Labels:
    return frozenset((k, v) for k, v in labels if k not in names)


def _select(scrape: Scrape, s: Selector) -> dict[Labels, float]:
    return {k: v for k, v in scrape.by_name.get(s.name or "", {}).items() if _matches(k, s.matchers)}


def _increase(points: Sequence[float]) -> float:
    """A counter's increase over `points`, a drop counted as a restart from 0."""
    total = 0.0
    for a, b in zip(points, points[1:], strict=False):
        total += b - a if b >= a else b
    return total


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over one histogram's (upper bound, cumulative count)."""
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    # Counts that fall with a higher bound (rates of counters scraped apart) are evened out.
    counts = [c for _, c in buckets]
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0 or math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rank = q * total
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start = buckets[b - 1][0] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    end, count = buckets[b][0], counts[b]
    return start + (end - start) * (rank - below) / (count - below) if count > below else end


_COMPARE = {
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


_FOLDS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "min": min,
    "max": max,
    "count": len,
    "avg": lambda vs: sum(vs) / len(vs),
}


def evaluate(node: Node, scrapes: Sequence[Scrape], i: int) -> Vector:
    """`node`'s instant vector at `scrapes[i]` (earlier scrapes give the ranges)."""
    if isinstance(node, Number):
        raise PromQLError("a number alone is not a vector")
    if isinstance(node, Selector):
        if node.range_s is not None:
            raise PromQLError("a range selector outside rate or increase")
        return {k | {(NAME, node.name or "")}: v for k, v in _select(scrapes[i], node).items()}
    if isinstance(node, Filter):
        return {k: v for k, v in evaluate(node.expr, scrapes, i).items() if _COMPARE[node.op](v, node.value)}
    if isinstance(node, Or):
        left = evaluate(node.left, scrapes, i)
        seen = {_without(k, NAME) for k in left}
        return {
            **left,
            **{k: v for k, v in evaluate(node.right, scrapes, i).items() if _without(k, NAME) not in seen},
        }
    if isinstance(node, Aggregation):
        groups: dict[Labels, list[float]] = defaultdict(list)
        for k, v in evaluate(node.expr, scrapes, i).items():
            if node.without:
                key = _without(k, NAME, *node.labels)
            else:
                key = frozenset((n, val) for n, val in k if n in node.labels)
            groups[key].append(v)
        fold = _FOLDS[node.op]
        return {k: float(fold(vs)) for k, vs in groups.items()}
    if node.function in RANGE_FUNCTIONS:
        (sel,) = node.args
        assert isinstance(sel, Selector) and sel.range_s is not None
        now = scrapes[i].t
        window = [s for s in scrapes[: i + 1] if s.t > now - sel.range_s - 1e-9]
        out: Vector = {}
        for k in _select(scrapes[i], sel):
            points = [
                (s.t, s.by_name[sel.name or ""][k]) for s in window if k in s.by_name.get(sel.name or "", {})
            ]
            if len(points) < 2 or points[-1][0] <= points[0][0]:
                continue
            grew = _increase([v for _, v in points])
            out[k] = grew / (points[-1][0] - points[0][0]) if node.function == "rate" else grew
        return out
    # histogram_quantile
    q_node, inner = node.args
    assert isinstance(q_node, Number)
    histograms: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for k, v in evaluate(inner, scrapes, i).items():
        le = dict(k).get("le")
        if le is not None:
            histograms[_without(k, NAME, "le")].append((float(le), v))
    return {k: q for k, b in histograms.items() if (q := _quantile(q_node.value, b)) is not None}


def series(query: str, scrapes: Sequence[Scrape]) -> dict[Labels, list[float | None]]:
    """`query` evaluated at every scrape: each series' values in scrape order (None where absent)."""
    node = parse(query)
    out: dict[Labels, list[float | None]] = {}
    for i in range(len(scrapes)):
        for k, v in evaluate(node, scrapes, i).items():
            out.setdefault(k, [None] * len(scrapes))[i] = v
    return out


def legend(template: str, labels: Labels) -> str:
    """A Grafana legendFormat (`p95 {{class}}`) filled in with a series' labels (an absent one as
    nothing); without a template, the labels as PromQL writes them."""
    have = dict(labels)
    if not template:
        name = have.pop(NAME, "")
        return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(have.items())) + "}"
    return re.sub(r"\{\{\s*([\w]+)\s*\}\}", lambda m: have.get(m.group(1), ""), template).strip()
