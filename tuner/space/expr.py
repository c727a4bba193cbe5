"""Expressions of space.yaml (constraints, derived values, launch geometry, seed conditions).

A small, safe subset of Python evaluated by walking the AST: names, numbers, strings,
arithmetic, comparisons, boolean logic, `a if c else b` and the functions
ceil_div/min/max/abs. Nothing else parses, and nothing can build an unbounded number.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from tuner.errors import UserError

MAX_TEXT_CHARS = 2000   # an expression longer than this is not a constraint, it is an attack
MAX_DEPTH = 64          # AST nesting (the shipped space needs 9)
MAX_INT_BITS = 256      # no intermediate result may be a larger integer ...
MAX_STR_CHARS = 4096    # ... or a longer string (`+` on strings)
MAX_EXPONENT = 64       # `**` and `<<`: the exponent or shift
_SHOWN_CHARS = 80       # how much of an expression an error message quotes


def _show(text: str) -> str:
    """An expression as error messages quote it: short (the text may be 2000 characters)."""
    return repr(text) if len(text) <= _SHOWN_CHARS else repr(text[:_SHOWN_CHARS]) + f"... ({len(text)} characters)"


def _checked(value: Any) -> Any:
    """Every intermediate result: a bounded integer, a finite float, a short string or a tuple of
    them. An expression (perhaps written by an LLM) must not build a number that takes minutes
    (and ignores signals) to compute: (2**64)**64**... is refused at the first step over the bound."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError(f"an intermediate result is over {MAX_INT_BITS} bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"an intermediate result is not a finite number ({value})")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STR_CHARS:
            raise ValueError(f"a string over {MAX_STR_CHARS} characters")
        return value
    if isinstance(value, tuple):
        return value
    raise ValueError(f"a result of type {type(value).__name__} is not allowed")


def _bits(value: int) -> int:
    return int(value).bit_length()


def _pow(a, b):
    """`**` with the exponent capped and the result's size estimated before it is computed."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent {b} is over {MAX_EXPONENT}")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and (_bits(a) - 1) * b > MAX_INT_BITS:
            raise ValueError(f"an intermediate result is over {MAX_INT_BITS} bits")
    return _checked(operator.pow(a, b))


def _lshift(a, b):
    if isinstance(b, int) and abs(b) > MAX_EXPONENT:
        raise ValueError(f"shift {b} is over {MAX_EXPONENT}")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and _bits(a) + b > MAX_INT_BITS:
        raise ValueError(f"an intermediate result is over {MAX_INT_BITS} bits")
    return _checked(operator.lshift(a, b))


def _mul(a, b):
    """`*`, refusing to repeat a string or list into a memory bomb ("x" * 2**60) and products
    over the integer bound (checked on the operands' sizes, before multiplying)."""
    if isinstance(a, (str, list, tuple)) or isinstance(b, (str, list, tuple)):
        raise ValueError("repeating a string or list is not allowed")
    if isinstance(a, int) and isinstance(b, int) and _bits(a) + _bits(b) > MAX_INT_BITS + 1:
        raise ValueError(f"an intermediate result is over {MAX_INT_BITS} bits")
    return _checked(a * b)


def _plain(op):
    return lambda a, b: _checked(op(a, b))


_BINOPS = {
    ast.Add: _plain(operator.add), ast.Sub: _plain(operator.sub), ast.Mult: _mul,
    ast.FloorDiv: _plain(operator.floordiv), ast.Mod: _plain(operator.mod), ast.Pow: _pow,
    ast.Div: _plain(operator.truediv), ast.LShift: _lshift, ast.RShift: _plain(operator.rshift),
}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
}
_FUNCS = {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, "abs": abs}


def _depth(tree: ast.AST) -> int:
    """The AST's nesting depth, without recursion (the recursive checker comes after this)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


_MISSING = object()
_PLAIN = (int, float, str, bool)  # the value types the memo keys on (exact types: not their subclasses)
MEMO_ENTRIES = 1 << 16  # per expression; cleared when full


class Expr:
    """A parsed, checked expression; `eval(env)` computes it."""

    def __init__(self, text: str | int | float, where: str = ""):
        """`where` (file:line: key) starts every evaluation error's message."""
        if isinstance(text, int) and not isinstance(text, bool) and text.bit_length() > MAX_INT_BITS:
            raise ValueError(f"constant over {MAX_INT_BITS} bits")
        self.text = str(text)
        self.where = where
        if len(self.text) > MAX_TEXT_CHARS:
            raise ValueError(f"expression of {len(self.text)} characters; at most {MAX_TEXT_CHARS}")
        try:
            self.tree = ast.parse(self.text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"syntax error in expression {_show(self.text)}: {exc.msg}") from None
        except (RecursionError, MemoryError, ValueError):  # the parser's own stack; a 5000-digit literal
            raise ValueError(f"expression {_show(self.text)} is too deeply nested or too large") from None
        if _depth(self.tree) > MAX_DEPTH:
            raise ValueError(f"expression {_show(self.text)} is nested over {MAX_DEPTH} deep")
        self.names: set[str] = set()
        self._check(self.tree)
        self._order = tuple(sorted(self.names))
        self._memo: dict[tuple, Any] = {}

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            self.names.add(node.id)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, str, bool)):
                raise ValueError(f"constant {_brief(node.value)} not allowed in {_show(self.text)}")
            try:
                _checked(node.value)
            except ValueError as exc:
                raise ValueError(f"constant in {_show(self.text)}: {exc}") from None
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
            raise ValueError(f"{type(node).__name__} not allowed in expression {_show(self.text)}")

    def eval(self, env: dict[str, Any]) -> Any:
        """The value at `env`. Memoized on the values (and their types: True is not 1 here) of
        the names the expression reads: a catalogue ranking checks every constraint at every
        run-time variant of every config, and most constraints read compile-time knobs only."""
        values = [env.get(n, _MISSING) for n in self._order]
        if not all(type(v) in _PLAIN for v in values):
            return self._evaluate(env)  # a tuple (equal to one of other element types), a missing name
        # floats by their bits: -0.0 is not 0.0 here, and a NaN finds itself
        key = tuple((type(v), v.hex() if type(v) is float else v) for v in values)
        try:
            return self._memo[key]
        except KeyError:
            pass
        value = self._evaluate(env)
        if len(self._memo) >= MEMO_ENTRIES:
            self._memo.clear()
        self._memo[key] = value
        return value

    def _evaluate(self, env: dict[str, Any]) -> Any:
        try:
            return _checked(self._eval(self.tree, env))
        except (ArithmeticError, TypeError, KeyError, ValueError, RecursionError, MemoryError) as exc:
            where = f"{self.where}: " if self.where else ""
            raise UserError(f"{where}expression {_show(self.text)} failed: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None

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
            return (not value) if isinstance(node.op, ast.Not) else _checked(-value if isinstance(node.op, ast.USub)
                                                                             else value)
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
            return _checked(_FUNCS[node.func.id](*(ev(a, env) for a in node.args)))  # type: ignore[union-attr]
        raise AssertionError(node)  # _check rejected everything else



def _brief(value: Any) -> str:
    return repr(value)[:_SHOWN_CHARS]
