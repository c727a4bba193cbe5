"""Expressions of space.yaml (constraints, derived values, launch geometry, seed conditions).

A small, safe subset of Python evaluated by walking the AST: names, numbers, strings,
arithmetic, comparisons, boolean logic, `a if c else b` and the functions
ceil_div/min/max/abs. Nothing else parses, and nothing can build an unbounded number.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from tuner.errors import UserError


def _bounded(op, limit: int = 64):
    """`**` and `<<` with the exponent or shift capped: an expression (perhaps written by an
    LLM) must not be able to build a number that exhausts memory or time."""
    def apply(a, b):
        if isinstance(b, (int, float)) and abs(b) > limit:
            raise ValueError(f"exponent or shift {b} is over {limit}")
        return op(a, b)
    return apply


def _mul(a, b):
    """`*`, refusing to repeat a string or list into a memory bomb ("x" * 2**60)."""
    if isinstance(a, (str, list, tuple)) or isinstance(b, (str, list, tuple)):
        raise ValueError("repeating a string or list is not allowed")
    return a * b


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _bounded(operator.pow),
    ast.Div: operator.truediv, ast.LShift: _bounded(operator.lshift), ast.RShift: operator.rshift,
}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
}
_FUNCS = {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, "abs": abs}


class Expr:
    """A parsed, checked expression; `eval(env)` computes it."""

    def __init__(self, text: str | int | float):
        self.text = str(text)
        try:
            self.tree = ast.parse(self.text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"syntax error in expression {self.text!r}: {exc.msg}") from None
        self.names: set[str] = set()
        self._check(self.tree)

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            self.names.add(node.id)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, str, bool)):
                raise ValueError(f"constant {node.value!r} not allowed in {self.text!r}")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not, ast.UAdd)):
            self._check(node.operand)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            self._check(node.left)
            for comp in node.comparators:
                self._check(comp)
        elif isinstance(node, ast.IfExp):
            for sub in (node.test, node.body, node.orelse):
                self._check(sub)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._check(elt)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _FUNCS and not node.keywords):
            for arg in node.args:
                self._check(arg)
        else:
            raise ValueError(f"{type(node).__name__} not allowed in expression {self.text!r}")

    def eval(self, env: dict[str, Any]) -> Any:
        try:
            return self._eval(self.tree, env)
        except (ArithmeticError, TypeError, KeyError, ValueError) as exc:
            raise UserError(f"expression {self.text!r} failed: {type(exc).__name__}: {exc}") from None

    def _eval(self, node: ast.AST, env: dict[str, Any]) -> Any:
        ev = self._eval
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left, env), ev(node.right, env))
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand, env)
            return (not value) if isinstance(node.op, ast.Not) else (-value if isinstance(node.op, ast.USub) else value)
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                return all(ev(v, env) for v in node.values)
            return any(ev(v, env) for v in node.values)
        if isinstance(node, ast.Compare):
            left = ev(node.left, env)
            for op, comp in zip(node.ops, node.comparators, strict=False):
                right = ev(comp, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body, env) if ev(node.test, env) else ev(node.orelse, env)
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(ev(e, env) for e in node.elts)
        if isinstance(node, ast.Call):
            return _FUNCS[node.func.id](*(ev(a, env) for a in node.args))  # type: ignore[union-attr]
        raise AssertionError(node)  # _check rejected everything else

