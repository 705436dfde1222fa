"""Bugs injected into real code: one-line AST mutations, as SWE-smith makes its tasks.

Each operator changes one node on one line (a comparison flipped, a constant off by one, an
operator swapped, a condition negated, two arguments swapped, a branch's body dropped). The
mutated module is the original text with that line's segment replaced, so everything else, the
comments included, stays as the author wrote it; a site is kept only when the new text parses to
exactly the mutated tree.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

FLIPPED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
SWAPPED: dict[type[ast.AST], type[ast.AST]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
    ast.And: ast.Or, ast.Or: ast.And, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
}  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    """One injected bug: its operator, its line (1-based), and that line before and after."""

    operator: str
    line: int
    before: str
    after: str
    source: str  # the whole mutated module


def _flip_comparison(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in FLIPPED:
        return ast.Compare(node.left, [FLIPPED[type(node.ops[0])]()], node.comparators)
    return None


def _off_by_one(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return ast.Constant(node.value + 1)
    return None


def _wrong_operator(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.BinOp) and type(node.op) in SWAPPED:
        return ast.BinOp(node.left, SWAPPED[type(node.op)](), node.right)
    if isinstance(node, ast.BoolOp) and type(node.op) in SWAPPED:
        return ast.BoolOp(SWAPPED[type(node.op)](), node.values)
    return None


def _negated_condition(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.If | ast.While) and node.test.lineno == node.lineno:
        return ast.UnaryOp(ast.Not(), node.test)  # replaces the test (see `_target`)
    return None


def _swapped_arguments(node: ast.AST) -> ast.AST | None:
    args = getattr(node, "args", None)
    if isinstance(node, ast.Call) and len(args) >= 2 and not any(isinstance(a, ast.Starred) for a in args[:2]):
        if ast.dump(args[0]) != ast.dump(args[1]):
            return ast.Call(node.func, [args[1], args[0], *args[2:]], node.keywords)
    return None


def _dropped_branch(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.If) and not node.orelse and len(node.body) == 1:
        body = node.body[0]
        if body.lineno == body.end_lineno and body.lineno > node.lineno and not isinstance(body, ast.Pass):
            return ast.Pass()  # replaces the body (see `_target`)
    return None


OPERATORS: dict[str, Callable[[ast.AST], ast.AST | None]] = {
    "flip_comparison": _flip_comparison,
    "off_by_one": _off_by_one,
    "wrong_operator": _wrong_operator,
    "negated_condition": _negated_condition,
    "swapped_arguments": _swapped_arguments,
    "dropped_branch": _dropped_branch,
}


def _target(operator: str, node: ast.AST) -> ast.AST:
    """The node whose text the mutation replaces: the condition of a negated `if`, the body of a dropped one."""
    if operator == "negated_condition":
        return node.test
    if operator == "dropped_branch":
        return node.body[0]
    return node


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of docstring constants: a mutation there changes no behaviour."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


@dataclass(frozen=True)
class Site:
    """Where an operator applies: the statement holding it (its path of fields from the module) and
    the node to replace inside that statement (its index in `ast.walk` order)."""

    operator: str
    line: int
    path: tuple[tuple[str, int | None], ...]
    index: int


def sites(source: str) -> list[Site]:
    """Every place a one-line mutation applies, in a fixed order (cheap: nothing is rewritten yet)."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for path, statement in _statements(tree, ()):
        own = list(_own_nodes(statement))
        for index, node in enumerate(own):
            for name, operator in OPERATORS.items():
                if id(node) in skip or operator(node) is None:
                    continue
                target = _target(name, node)
                if target.lineno == target.end_lineno:
                    found.append(Site(name, target.lineno, path, index))
    return found


def _statements(node: ast.AST, path: tuple) -> Iterator[tuple[tuple, ast.stmt]]:
    """Every statement with its path of (field, index) from the module."""
    for name, value in ast.iter_fields(node):
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, ast.stmt):
                step = (*path, (name, i if isinstance(value, list) else None))
                yield step, item
                yield from _statements(item, step)


def _own_nodes(statement: ast.stmt) -> Iterator[ast.AST]:
    """The statement and the nodes of its expressions, not those of statements nested in it."""
    yield statement
    stack = [v for _, v in ast.iter_fields(statement)]
    while stack:
        value = stack.pop(0)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, ast.AST) and not isinstance(item, ast.stmt):
                yield item
                stack.extend(v for _, v in ast.iter_fields(item))


def _at(tree: ast.AST, path: tuple) -> ast.stmt:
    node = tree
    for name, i in path:
        value = getattr(node, name)
        node = value[i] if i is not None else value
    return node


def apply(source: str, site: Site) -> Mutation | None:
    """The mutated module, or None where the replaced text would not parse to the mutated tree."""
    statement = copy.deepcopy(_at(ast.parse(source), site.path))
    node = list(_own_nodes(statement))[site.index]
    new, target = OPERATORS[site.operator](node), _target(site.operator, node)
    expected = ast.dump(_replace(statement, target, new))
    lines = source.splitlines(keepends=True)
    row = target.lineno - 1
    line = lines[row]
    start, end = _byte_to_char(line, target.col_offset), _byte_to_char(line, target.end_col_offset)
    for text in (ast.unparse(new), f"({ast.unparse(new)})"):
        changed = line[:start] + text + line[end:]
        mutated = "".join(lines[:row] + [changed] + lines[row + 1 :])
        try:
            if ast.dump(_at(ast.parse(mutated), site.path)) == expected:
                return Mutation(site.operator, site.line, line.rstrip("\n"), changed.rstrip("\n"), mutated)
        except (SyntaxError, AttributeError, IndexError):
            continue
    return None


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> ast.AST:
    """`tree` with the node `old` (by identity) replaced by `new`."""

    class Replace(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            return new if node is old else self.generic_visit(node)

    return Replace().visit(tree)


def _byte_to_char(line: str, offset: int) -> int:
    """ast's column offsets count UTF-8 bytes."""
    return len(line.encode("utf-8")[:offset].decode("utf-8", "replace"))
