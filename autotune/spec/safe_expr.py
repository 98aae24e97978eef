"""A small safe evaluator for constraint expressions such as ``heads % tp == 0``.

Specs are user input, so ``eval`` is out. An expression is parsed with :mod:`ast` and only
arithmetic, comparisons, boolean logic, conditional expressions, constants, names and the
functions ``min``/``max``/``abs`` are accepted. The compiled form works on scalars *and* on numpy
arrays (one column per name), so the space can check every config of a spec in one vectorised
pass.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["ExpressionError", "Expression", "compile_expression"]


class ExpressionError(ValueError):
    """The expression is not in the accepted subset, or names something unknown."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_FUNCS: dict[str, Callable[..., Any]] = {"min": np.minimum, "max": np.maximum, "abs": np.abs}


def _and(a: Any, b: Any) -> Any:
    return np.logical_and(a, b)


def _or(a: Any, b: Any) -> Any:
    return np.logical_or(a, b)


def _in(a: Any, options: tuple[Any, ...]) -> Any:
    if isinstance(a, np.ndarray):
        return np.isin(a, list(options))
    return a in options


@dataclass(frozen=True)
class Expression:
    """A compiled constraint: ``source`` for messages, ``names`` it reads, ``evaluate(env)``."""

    source: str
    names: frozenset[str]
    _fn: Callable[[Mapping[str, Any]], Any]

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Value over ``env`` (scalars or equal-length numpy columns). Missing names raise."""
        missing = self.names - set(env)
        if missing:
            raise ExpressionError(f"{self.source!r}: unknown name(s) {sorted(missing)}")
        try:
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                return self._fn(env)
        except (TypeError, ValueError, ArithmeticError, MemoryError) as exc:  # e.g. a string parameter in arithmetic
            raise ExpressionError(f"{self.source!r} cannot be evaluated: {type(exc).__name__}: {exc}") from None


# What an expression may compute is bounded, so that a spec cannot hang or exhaust the host:
# its length and size, the size of its constants, and powers (a constant, small exponent only:
# ``9**9**9`` is refused, not computed). Strings only compare; they take part in no arithmetic
# (``'a' * 10**10`` would be a 10 GB string).
MAX_SOURCE_CHARS = 1000
MAX_NODES = 200
MAX_DEPTH = 32
MAX_INT = 10**15
MAX_STRING = 256
MAX_EXPONENT = 64
MAX_POWERS = 2


def compile_expression(source: str, allowed_names: set[str] | None = None) -> Expression:
    """Parse ``source`` into an :class:`Expression`; reject anything outside the safe subset.

    ``allowed_names``, when given, is checked now so a typo fails at spec validation with the
    list of names that exist, rather than halfway through a study.
    """
    if not isinstance(source, str):
        raise ExpressionError(f"{source!r} is not an expression (a string such as 'heads % tp == 0')")
    if len(source) > MAX_SOURCE_CHARS:
        raise ExpressionError(
            f"the expression is {len(source):,} characters long; at most {MAX_SOURCE_CHARS} are "
            "accepted (split it into several constraints)"
        )
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"{source!r} is not a valid expression: {getattr(exc, 'msg', exc)}") from None
    _check_bounds(tree, source)
    names: set[str] = set()
    fn = _compile(tree.body, source, names)
    if allowed_names is not None:
        unknown = names - allowed_names
        if unknown:
            raise ExpressionError(
                f"{source!r} uses unknown name(s) {sorted(unknown)}; known names: {', '.join(sorted(allowed_names))}"
            )
    return Expression(source, frozenset(names), fn)


def _check_bounds(tree: ast.AST, source: str) -> None:
    """Size, depth, constants, powers and string arithmetic, checked before anything is compiled
    (iteratively: a deep expression must not exhaust the checker's own stack)."""
    count = powers = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ExpressionError(f"{source!r}: more than {MAX_NODES} terms; split it into several constraints")
        if depth > MAX_DEPTH:
            raise ExpressionError(f"{source!r}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
                raise ExpressionError(f"{source!r}: the constant {value:.3g} is larger than {MAX_INT:.0e}")
            if isinstance(value, float) and not abs(value) <= 1e18:
                raise ExpressionError(f"{source!r}: the constant {value!r} is out of range (at most 1e18)")
            if isinstance(value, str) and len(value) > MAX_STRING:
                raise ExpressionError(
                    f"{source!r}: a string constant of {len(value)} characters (at most {MAX_STRING})"
                )
        if isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    raise ExpressionError(
                        f"{source!r}: strings only compare (==, !=, in); "
                        f"{side.value[:20]!r} cannot take part in arithmetic"
                    )
            powers += isinstance(node.op, ast.Pow)
            if powers > MAX_POWERS:
                raise ExpressionError(f"{source!r}: at most {MAX_POWERS} ** in one expression")
            if isinstance(node.op, ast.Pow) and _constant_exponent(node.right) is None:
                raise ExpressionError(
                    f"{source!r}: ** needs a constant whole exponent between -{MAX_EXPONENT} "
                    f"and {MAX_EXPONENT} (e.g. tp ** 2)"
                )
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _constant_exponent(node: ast.AST) -> int | None:
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -1 if isinstance(node.op, ast.USub) else 1
        node = node.operand
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
        and abs(node.value) <= MAX_EXPONENT
    ):
        return sign * node.value
    return None


def _compile(node: ast.AST, source: str, names: set[str]) -> Callable[[Mapping[str, Any]], Any]:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        value = node.value
        return lambda env: value
    if isinstance(node, ast.Name):
        if node.id in ("True", "False"):
            value = node.id == "True"
            return lambda env: value
        name = node.id
        names.add(name)
        return lambda env: env[name]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "env":
        # env.VAR reads the flattened environment parameter "env.VAR"
        name = f"env.{node.attr}"
        names.add(name)
        return lambda env: env[name]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        op = _BINOPS[type(node.op)]
        left, right = _compile(node.left, source, names), _compile(node.right, source, names)
        return lambda env: op(left(env), right(env))
    if isinstance(node, ast.UnaryOp):
        operand = _compile(node.operand, source, names)
        if isinstance(node.op, ast.Not):
            return lambda env: np.logical_not(operand(env))
        if isinstance(node.op, ast.USub):
            return lambda env: -operand(env)
        if isinstance(node.op, ast.UAdd):
            return operand
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v, source, names) for v in node.values]
        combine = _and if isinstance(node.op, ast.And) else _or

        def boolop(env: Mapping[str, Any]) -> Any:
            result = parts[0](env)
            for part in parts[1:]:
                result = combine(result, part(env))
            return result

        return boolop
    if isinstance(node, ast.Compare):
        left = _compile(node.left, source, names)
        steps = []
        for op_node, comparator in zip(node.ops, node.comparators):
            if isinstance(op_node, (ast.In, ast.NotIn)):
                if not isinstance(comparator, (ast.Tuple, ast.List, ast.Set)) or not all(
                    isinstance(e, ast.Constant) for e in comparator.elts
                ):
                    raise ExpressionError(f"{source!r}: 'in' needs a literal list of constants")
                options = tuple(e.value for e in comparator.elts)  # type: ignore[attr-defined]
                negate = isinstance(op_node, ast.NotIn)
                steps.append(("in", options, negate))
            elif type(op_node) in _CMPOPS:
                steps.append(("cmp", _CMPOPS[type(op_node)], _compile(comparator, source, names)))
            else:
                raise ExpressionError(f"{source!r}: comparison {type(op_node).__name__} is not allowed")

        def compare(env: Mapping[str, Any]) -> Any:
            current = left(env)
            result: Any = True
            for kind, a, b in steps:
                if kind == "in":
                    value = _in(current, a)
                    value = np.logical_not(value) if b else value
                else:
                    right = b(env)
                    value = a(current, right)
                    current = right
                result = np.logical_and(result, value)
            return result

        return compare
    if isinstance(node, ast.IfExp):
        test, body, orelse = (_compile(n, source, names) for n in (node.test, node.body, node.orelse))
        return lambda env: np.where(test(env), body(env), orelse(env))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        func = _FUNCS[node.func.id]
        args = [_compile(a, source, names) for a in node.args]
        if node.func.id in ("min", "max"):
            if len(args) < 2:
                raise ExpressionError(f"{source!r}: {node.func.id}() needs at least two arguments")

            def reduce_call(env: Mapping[str, Any]) -> Any:
                result = args[0](env)
                for arg in args[1:]:
                    result = func(result, arg(env))
                return result

            return reduce_call
        if len(args) != 1:
            raise ExpressionError(f"{source!r}: abs() takes one argument")
        return lambda env: func(args[0](env))
    raise ExpressionError(
        f"{source!r}: {type(node).__name__} is not allowed "
        "(use numbers, strings, names, + - * / // % **, comparisons, and/or/not, min/max/abs, x if c else y)"
    )
