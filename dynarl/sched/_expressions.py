"""Expression evaluation and call application for the extractor's interpreter."""

from __future__ import annotations

import ast
import builtins
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from dynarl.sched._symbols import (
    CHANNEL_OPS,
    ChanV,
    ClassV,
    ConstV,
    Ext,
    FuncV,
    InstanceV,
    MapV,
    MethodV,
    Mod,
    Scope,
    SeqV,
    SuperV,
    Unknown,
    Vals,
    Value,
    cap,
    one,
    plain_unknown,
    truth,
)

if TYPE_CHECKING:
    from dynarl.sched._interpreter import Interpreter

__all__ = ["Expressions"]

UNROLL_LIMIT = 64
_BUILTINS = frozenset(dir(builtins))
_FOLD: dict[type[ast.operator], Callable[[object, object], object]] = {
    ast.Add: lambda a, b: a + b,  # type: ignore[operator]
    ast.Sub: lambda a, b: a - b,  # type: ignore[operator]
    ast.Mult: lambda a, b: a * b,  # type: ignore[operator]
    ast.Mod: lambda a, b: a % b,  # type: ignore[operator]
    ast.FloorDiv: lambda a, b: a // b,  # type: ignore[operator]
}


def _closure(scope: Scope) -> Scope:
    return scope.parent if scope.is_class and scope.parent else scope


def _const(value: object) -> Vals:
    try:
        hash(value)
    except TypeError:
        return plain_unknown("an unhashable constant")
    return one(ConstV(value))


class Expressions:
    """Evaluates expressions to value sets on behalf of an :class:`Interpreter`."""

    def __init__(self, interp: Interpreter) -> None:
        self.interp = interp

    def eval(self, node: ast.expr, scope: Scope) -> Vals:
        """The possible values of ``node`` in ``scope``."""
        handler = getattr(self, "_" + type(node).__name__, None)
        if handler is None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.eval(child, scope)
            return plain_unknown(f"a `{type(node).__name__}` expression")
        return cap(handler(node, scope))

    # ------------------------------------------------------------ expressions
    def _Constant(self, node: ast.Constant, scope: Scope) -> Vals:
        return _const(node.value)

    def _Name(self, node: ast.Name, scope: Scope) -> Vals:
        found = scope.lookup(node.id)
        if found is not None:
            return found
        if node.id in _BUILTINS:
            return one(Ext(f"builtins.{node.id}"))
        return one(Unknown(f"name `{node.id}` is not defined", suspicious=True))

    def _Attribute(self, node: ast.Attribute, scope: Scope) -> Vals:
        values = self.eval(node.value, scope)
        return frozenset().union(*(self.attribute(v, node.attr) for v in values))

    def _Call(self, node: ast.Call, scope: Scope) -> Vals:
        return self.interp.calls.call(node, scope)

    def _Await(self, node: ast.Await, scope: Scope) -> Vals:
        return self.eval(node.value, scope)

    def _Starred(self, node: ast.Starred, scope: Scope) -> Vals:
        return self.eval(node.value, scope)

    def _JoinedStr(self, node: ast.JoinedStr, scope: Scope) -> Vals:
        options: list[list[str]] = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                options.append([str(part.value)])
                continue
            value = part.value if isinstance(part, ast.FormattedValue) else part
            vals = self.eval(value, scope)
            if not all(isinstance(v, ConstV) for v in vals):
                return plain_unknown(f"f-string `{ast.unparse(node)}` has a non-constant part")
            options.append([str(v.value) for v in vals if isinstance(v, ConstV)])
        joined = itertools.islice(itertools.product(*options), 64)
        return frozenset(ConstV("".join(parts)) for parts in joined)

    def _BinOp(self, node: ast.BinOp, scope: Scope) -> Vals:
        left, right = self.eval(node.left, scope), self.eval(node.right, scope)
        fold = _FOLD.get(type(node.op))
        if fold is None or not all(isinstance(v, ConstV) for v in left | right):
            return plain_unknown("arithmetic on non-constants")
        out: set[Value] = set()
        for a, b in itertools.product(left, right):
            try:
                out |= _const(fold(a.value, b.value))  # type: ignore[union-attr]
            except Exception:
                out |= plain_unknown("arithmetic that fails")
        return frozenset(out)

    def _UnaryOp(self, node: ast.UnaryOp, scope: Scope) -> Vals:
        operand = self.eval(node.operand, scope)
        if isinstance(node.op, ast.Not):
            value = truth(operand)
            return plain_unknown("a negation") if value is None else one(ConstV(not value))
        numbers = [v.value for v in operand if isinstance(v, ConstV)]
        if len(numbers) != len(operand) or not all(
            isinstance(n, int | float) and not isinstance(n, bool) for n in numbers
        ):
            return plain_unknown("a unary operation on non-numbers")
        sign = -1 if isinstance(node.op, ast.USub) else 1
        return frozenset(ConstV(sign * n) for n in numbers)  # type: ignore[operator]

    def _BoolOp(self, node: ast.BoolOp, scope: Scope) -> Vals:
        return frozenset().union(*(self.eval(v, scope) for v in node.values))

    def _Compare(self, node: ast.Compare, scope: Scope) -> Vals:
        left = self.eval(node.left, scope)
        rights = [self.eval(c, scope) for c in node.comparators]
        if len(rights) == 1 and len(left) == len(rights[0]) == 1:
            (a,), (b,) = left, rights[0]
            if isinstance(a, ConstV) and isinstance(b, ConstV):
                op = node.ops[0]
                if isinstance(op, ast.Eq | ast.Is):
                    return one(ConstV(a.value == b.value))
                if isinstance(op, ast.NotEq | ast.IsNot):
                    return one(ConstV(a.value != b.value))
        return plain_unknown("a comparison")

    def _IfExp(self, node: ast.IfExp, scope: Scope) -> Vals:
        value = truth(self.eval(node.test, scope))
        if value is not None:
            return self.eval(node.body if value else node.orelse, scope)
        return self.eval(node.body, scope) | self.eval(node.orelse, scope)

    def _Tuple(self, node: ast.Tuple | ast.List | ast.Set, scope: Scope) -> Vals:
        items: list[Vals] = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                spread = self.iterate(self.eval(elt.value, scope))
                if spread is None or len(spread) != 1:
                    return plain_unknown("a starred item of unknown length")
                items.extend(spread[0])
            else:
                items.append(self.eval(elt, scope))
        return one(SeqV(tuple(items)))

    _List = _Tuple
    _Set = _Tuple

    def _Dict(self, node: ast.Dict, scope: Scope) -> Vals:
        result = MapV(())
        for key, value in zip(node.keys, node.values, strict=True):
            vals = self.eval(value, scope)
            if key is None:
                maps = [v for v in vals if isinstance(v, MapV)]
                if len(maps) != 1 or len(vals) != 1:
                    return plain_unknown("a dict merged from an unknown mapping")
                for k, v in maps[0].items:
                    result = result.with_item(k, v)
                continue
            keys = self.eval(key, scope)
            if len(keys) != 1 or not isinstance(next(iter(keys)), ConstV):
                return plain_unknown("a dict with non-constant keys")
            result = result.with_item(next(iter(keys)).value, vals)  # type: ignore[union-attr]
        return one(result)

    def _Subscript(self, node: ast.Subscript, scope: Scope) -> Vals:
        if isinstance(node.slice, ast.Slice):
            return self._slice(node, node.slice, scope)
        objs, keys = self.eval(node.value, scope), self.eval(node.slice, scope)
        out: set[Value] = set()
        for obj in objs:
            if isinstance(obj, Unknown):
                out.add(obj)
            elif not isinstance(obj, SeqV | MapV):
                out |= plain_unknown("an item of a value the extractor does not model")
            elif not all(isinstance(k, ConstV) for k in keys):
                reason = f"`{ast.unparse(node)}` is indexed by a non-constant key"
                out.add(Unknown(reason, suspicious=True))
            else:
                for key in keys:
                    out |= _item(obj, key.value, node)  # type: ignore[union-attr]
        return frozenset(out)

    def _slice(self, node: ast.Subscript, part: ast.Slice, scope: Scope) -> Vals:
        bounds: list[int | None] = []
        for bound in (part.lower, part.upper, part.step):
            vals = self.eval(bound, scope) if bound is not None else one(ConstV(None))
            value = next(iter(vals)) if len(vals) == 1 else None
            if not isinstance(value, ConstV) or not isinstance(value.value, int | None):
                return plain_unknown(f"`{ast.unparse(node)}` is sliced by non-constants")
            bounds.append(value.value)
        cut = slice(*bounds)
        out: set[Value] = set()
        for obj in self.eval(node.value, scope):
            if isinstance(obj, SeqV):
                out.add(SeqV(obj.items[cut]))
            else:
                out |= plain_unknown(f"`{ast.unparse(node)}` slices an untracked value")
        return frozenset(out)

    def _Lambda(self, node: ast.Lambda, scope: Scope) -> Vals:
        return one(FuncV(scope.module, node, _closure(scope)))

    def _NamedExpr(self, node: ast.NamedExpr, scope: Scope) -> Vals:
        vals = self.eval(node.value, scope)
        self.interp.assign(node.target, vals, scope)
        return vals

    def _ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp, scope: Scope) -> Vals:
        items: list[Vals] = []
        self._comprehend(node.generators, scope, lambda s: items.append(self.eval(node.elt, s)))
        return one(SeqV(tuple(items)))

    _SetComp = _ListComp
    _GeneratorExp = _ListComp

    def _DictComp(self, node: ast.DictComp, scope: Scope) -> Vals:
        pairs: list[tuple[Vals, Vals]] = []
        self._comprehend(
            node.generators,
            scope,
            lambda s: pairs.append((self.eval(node.key, s), self.eval(node.value, s))),
        )
        result = MapV(())
        for keys, vals in pairs:
            if len(keys) != 1 or not isinstance(next(iter(keys)), ConstV):
                return plain_unknown("a dict comprehension with non-constant keys")
            result = result.with_item(next(iter(keys)).value, vals)  # type: ignore[union-attr]
        return one(result)

    def _comprehend(
        self, generators: list[ast.comprehension], scope: Scope, emit: Callable[[Scope], None]
    ) -> None:
        if not generators:
            emit(scope)
            return
        first, rest = generators[0], generators[1:]
        iterable = self.iterate(self.eval(first.iter, scope))
        if iterable is None:
            reason = f"loop variable over `{ast.unparse(first.iter)}`, which is not enumerable"
            iterable = [[one(Unknown(reason, suspicious=True))]]
        for items in iterable:
            for item in items:
                child = Scope(scope.module, scope)
                self.interp.assign(first.target, item, child)
                if all(truth(self.eval(cond, child)) is not False for cond in first.ifs):
                    self._comprehend(rest, child, emit)

    # ---------------------------------------------------------------- helpers
    def iterate(self, vals: Vals) -> list[list[Vals]] | None:
        """Item lists of each alternative, or None when one cannot be enumerated."""
        alternatives: list[list[Vals]] = []
        for v in vals:
            if isinstance(v, SeqV) and len(v.items) <= UNROLL_LIMIT:
                alternatives.append(list(v.items))
            elif isinstance(v, MapV) and len(v.items) <= UNROLL_LIMIT:
                alternatives.append([_const(k) for k, _ in v.items])
            else:
                return None
        return alternatives or None

    def mutation(self, node: ast.expr, scope: Scope) -> bool:
        """Apply ``x.append(v)`` and friends to a tracked container; False if not one."""
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "add", "extend", "update", "insert")
            and isinstance(node.func.value, ast.Name | ast.Attribute)
            and node.args
        ):
            return False
        method, receiver = node.func.attr, node.func.value
        arg = self.eval(node.args[-1], scope)
        updated: set[Value] = set()
        for current in self.eval(receiver, scope):
            if isinstance(current, SeqV) and method in ("append", "add", "insert"):
                updated.add(SeqV((*current.items, arg)))
            elif isinstance(current, SeqV) and method == "extend":
                spread = self.iterate(arg)
                if spread is None:
                    return False
                updated.update(SeqV((*current.items, *items)) for items in spread)
            elif isinstance(current, MapV) and method == "update":
                for other in arg:
                    if not isinstance(other, MapV):
                        return False
                    merged = current
                    for k, v in other.items:
                        merged = merged.with_item(k, v)
                    updated.add(merged)
            else:
                return False
        self.interp.assign(receiver, frozenset(updated), scope)
        return True

    def with_item(self, objs: Vals, key: ast.expr, vals: Vals, scope: Scope) -> Vals | None:
        """The containers ``objs`` after ``obj[key] = vals``, or None if none is tracked."""
        keys = self.eval(key, scope)
        tracked = [o for o in objs if isinstance(o, MapV)]
        if not tracked:
            return None
        if len(keys) != 1 or not isinstance(next(iter(keys)), ConstV):
            reason = f"item assigned under the non-constant key `{ast.unparse(key)}`"
            return one(Unknown(reason, suspicious=True))
        k = next(iter(keys)).value  # type: ignore[union-attr]
        return frozenset(o.with_item(k, vals) for o in tracked)

    def attribute(self, value: Value, attr: str) -> Vals:
        """``value.attr``."""
        interp = self.interp
        match value:
            case Ext(path=path):
                return one(Ext(f"{path}.{attr}"))
            case Mod(name=name):
                return interp.import_name(name, attr)
            case ClassV():
                found = interp.class_attr(value, attr, bound=None)
                return found or one(Unknown(f"class has no attribute `{attr}`", suspicious=True))
            case InstanceV():
                return self._instance_attr(value, attr)
            case SuperV(cls=cls, self_=self_):
                return self._super_attr(cls, self_, attr)
            case ChanV() if attr in CHANNEL_OPS:
                return one(MethodV(value, attr))
            case MapV() if attr in ("items", "keys", "values", "get"):
                return one(MethodV(value, attr))
            case Unknown():
                return one(value)
        return plain_unknown(f"attribute `{attr}` of a value the extractor does not model")

    def _instance_attr(self, instance: InstanceV, attr: str) -> Vals:
        stored = self.interp.stores.get(instance.key, {}).get(attr)
        declared = self.interp.class_attr(instance.cls, attr, bound=instance, fallback=False)
        if stored is None and declared is None:
            fallback = self.interp.class_attr(instance.cls, attr, bound=instance)
            reason = f"attribute `{attr}` of `{instance.cls.node.name}` is never assigned"
            return fallback or one(Unknown(reason, suspicious=True))
        return (stored or frozenset()) | (declared or frozenset())

    def _super_attr(self, cls: ClassV, self_: InstanceV, attr: str) -> Vals:
        order, _ = self.interp.mro(self_.cls)
        after = order[order.index(cls) + 1 :] if cls in order else []
        for current in after:
            found = self.interp.class_attr(current, attr, bound=self_, fallback=False)
            if found is not None and attr in self.interp.classes[current.node].namespace:
                return found
        reason = f"`super().{attr}` is not analysed"
        return one(Unknown(reason, suspicious=not attr.startswith("__")))


def _item(obj: SeqV | MapV, key: object, node: ast.expr) -> Vals:
    if isinstance(obj, MapV):
        found = obj.get(key)
        if found is not None:
            return found
        return one(Unknown(f"`{ast.unparse(node)}`: no such key", suspicious=True))
    size = len(obj.items)
    if isinstance(key, int) and not isinstance(key, bool) and -size <= key < size:
        return obj.items[key]
    return plain_unknown(f"`{ast.unparse(node)}`: index out of the tracked range")
