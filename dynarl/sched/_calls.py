"""Call evaluation for the extractor's interpreter: channel operations, builtins, binding.

A call to a channel's ``put``/``get`` records an operation; one whose receiver is a
suspicious unknown records an unresolved site with the reason. ``dynarl.Channel("name")``
builds a channel value; calls to analysed functions are inlined with their parameters
bound; calls to analysed classes build objects (or record a component instantiation).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from dynarl.sched._symbols import (
    CHANNEL_OPS,
    Args,
    ChanV,
    ClassV,
    ConstV,
    Ext,
    FuncV,
    InstanceV,
    MapV,
    MethodV,
    Scope,
    SeqV,
    SuperV,
    Unknown,
    Vals,
    Value,
    is_dynarl,
    one,
    plain_unknown,
)

if TYPE_CHECKING:
    from dynarl.sched._interpreter import Interpreter

__all__ = ["Calls"]

_SEQUENCE_BUILTINS = frozenset({"list", "tuple", "sorted", "reversed", "set", "frozenset", "iter"})


class Calls:
    """Evaluates call expressions on behalf of an :class:`Interpreter`."""

    def __init__(self, interp: Interpreter) -> None:
        self.interp = interp

    def call(self, node: ast.Call, scope: Scope) -> Vals:
        """The possible results of the call ``node``; records channel operations."""
        special = self._reflection(node, scope)
        if special is not None:
            return special
        args = self.arguments(node, scope)
        results: set[Value] = set()
        for callee in self.interp.expr.eval(node.func, scope):
            results |= self.apply(callee, args, node, scope)
        return frozenset(results)

    def arguments(self, node: ast.Call, scope: Scope) -> Args:
        """Evaluate the arguments of a call, expanding ``*seq`` and ``**map`` it can."""
        ev = self.interp.expr.eval
        positional: list[Vals] = []
        keywords: list[tuple[str, Vals]] = []
        is_open = False
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                spread = self.interp.expr.iterate(ev(arg.value, scope))
                if spread is not None and len(spread) == 1:
                    positional.extend(spread[0])
                else:
                    is_open = True
            else:
                positional.append(ev(arg, scope))
        for kw in node.keywords:
            vals = ev(kw.value, scope)
            if kw.arg is not None:
                keywords.append((kw.arg, vals))
            elif len(vals) == 1 and isinstance(mapping := next(iter(vals)), MapV):
                keywords.extend((str(k), v) for k, v in mapping.items)
            else:
                is_open = True
        return Args(tuple(positional), tuple(sorted(keywords, key=lambda kv: kv[0])), is_open)

    def apply(self, callee: Value, args: Args, node: ast.Call, scope: Scope) -> Vals:
        """Call one possible callee."""
        interp = self.interp
        site = interp.site(scope, node)
        match callee:
            case MethodV(target=ChanV(name=channel), name=op) if op in CHANNEL_OPS:
                interp.sink.ops.add((channel, op, site))
                return plain_unknown("an item taken from a channel")
            case MethodV(target=MapV() as mapping, name=method):
                return _map_method(mapping, method, args)
            case Unknown(reason=reason, suspicious=True) if _is_dispatch(node):
                interp.sink.unresolved.add((site, f"`{ast.unparse(node.func)}(...)`: {reason}"))
            case Ext():
                return self._external(callee, args, node, scope)
            case FuncV():
                return interp.invoke(callee, args, site)
            case ClassV():
                return interp.instantiate(callee, args, site)
        return plain_unknown("the result of a call the extractor does not model")

    def _reflection(self, node: ast.Call, scope: Scope) -> Vals | None:
        """``getattr``/``setattr`` with their real meaning; None for other calls."""
        func = node.func
        if not isinstance(func, ast.Name) or func.id not in ("getattr", "setattr"):
            return None
        if scope.lookup(func.id) is not None or len(node.args) < 2:
            return None
        ev = self.interp.expr.eval
        objs, names = ev(node.args[0], scope), ev(node.args[1], scope)
        if func.id == "setattr":
            value = ev(node.args[2], scope) if len(node.args) > 2 else plain_unknown("")
            for name in names:
                for obj in objs:
                    if isinstance(name, ConstV) and isinstance(obj, InstanceV):
                        self.interp.store(obj, str(name.value), value)
            return one(ConstV(None))
        results: set[Value] = set()
        for name in names:
            if isinstance(name, ConstV) and isinstance(name.value, str):
                for obj in objs:
                    results |= self.interp.expr.attribute(obj, name.value)
            else:
                reason = f"`{ast.unparse(node)}` looks up a non-constant attribute"
                results.add(Unknown(reason, suspicious=True))
        if len(node.args) > 2:
            results |= ev(node.args[2], scope)
        return frozenset(results)

    def _external(self, callee: Ext, args: Args, node: ast.Call, scope: Scope) -> Vals:
        if is_dynarl(callee, "Channel"):
            return _channel(args, node)
        name = callee.path.removeprefix("builtins.")
        if "." in name:
            return plain_unknown(f"the result of `{callee.path}(...)`")
        if name == "range":
            return _range(args)
        if name == "enumerate" and args.positional:
            return self._enumerate(args)
        if name == "zip":
            spreads = [self.interp.expr.iterate(a) for a in args.positional]
            if all(s is not None and len(s) == 1 for s in spreads):
                rows = zip(*(s[0] for s in spreads if s), strict=False)
                return one(SeqV(tuple(one(SeqV(tuple(row))) for row in rows)))
        if name in _SEQUENCE_BUILTINS:
            if not args.positional:
                return one(SeqV(()))
            spread = self.interp.expr.iterate(args.positional[0])
            if spread is not None:
                order = reversed if name == "reversed" else list
                return frozenset(SeqV(tuple(order(items))) for items in spread)
        if name == "dict" and not args.positional:
            return one(MapV(args.keywords))
        if name == "type" and len(args.positional) == 3:
            self._dynamic_class(args, node, scope)
        if name == "super":
            return self._super(scope)
        return plain_unknown(f"the result of `{name}(...)`")

    def _enumerate(self, args: Args) -> Vals:
        spread = self.interp.expr.iterate(args.positional[0])
        if spread is None:
            return plain_unknown("enumerate over a non-enumerable value")
        return frozenset(
            SeqV(tuple(one(SeqV((one(ConstV(i)), item))) for i, item in enumerate(items)))
            for items in spread
        )

    def _dynamic_class(self, args: Args, node: ast.Call, scope: Scope) -> None:
        bases = [v for alt in (self.interp.expr.iterate(args.positional[1]) or []) for v in alt]
        flat = [b for vals in bases for b in vals]
        derives = any(
            is_dynarl(b, "WorkerGroup") or (isinstance(b, ClassV) and self.interp.is_component(b))
            for b in flat
        )
        if derives:
            reason = "a WorkerGroup class built with type(); dynamic classes are not analysed"
            self.interp.issues.add((self.interp.site(scope, node), reason))

    def _super(self, scope: Scope) -> Vals:
        current: Scope | None = scope
        while current is not None and current.self_ is None:
            current = current.parent
        if current is None or current.owner is None or current.self_ is None:
            return plain_unknown("super() outside a method")
        return one(SuperV(current.owner, current.self_))

    # ---------------------------------------------------------------- binding
    def bind(self, func: FuncV, args: Args) -> dict[str, Vals]:
        """Parameter bindings of a call of ``func`` with ``args``."""
        spec = func.node.args
        params = [*spec.posonlyargs, *spec.args]
        positional = list(args.positional)
        if func.self_ is not None:
            positional.insert(0, one(func.self_))
        bound: dict[str, Vals] = {p.arg: v for p, v in zip(params, positional, strict=False)}
        if spec.vararg is not None:
            extra = tuple(positional[len(params) :])
            bound[spec.vararg.arg] = (
                self._unbound(func, spec.vararg) if args.open else one(SeqV(extra))
            )
        names = {p.arg for p in [*params, *spec.kwonlyargs]}
        extra_kw = []
        for key, vals in args.keywords:
            if key in names:
                bound[key] = vals
            else:
                extra_kw.append((key, vals))
        if spec.kwarg is not None:
            bound[spec.kwarg.arg] = one(MapV(tuple(extra_kw)))
        self._defaults(func, params, bound, args.open)
        return bound

    def _defaults(
        self, func: FuncV, params: list[ast.arg], bound: dict[str, Vals], is_open: bool
    ) -> None:
        spec = func.node.args
        assert isinstance(func.closure, Scope)
        with_default = [p.arg for p in params[len(params) - len(spec.defaults) :]]
        defaults: dict[str, ast.expr] = dict(zip(with_default, spec.defaults, strict=True))
        for arg, default in zip(spec.kwonlyargs, spec.kw_defaults, strict=True):
            if default is not None:
                defaults[arg.arg] = default
        for arg in [*params, *spec.kwonlyargs]:
            if arg.arg in bound:
                continue
            if arg.arg in defaults and not is_open:
                bound[arg.arg] = self.interp.expr.eval(defaults[arg.arg], func.closure)
            else:
                bound[arg.arg] = self._unbound(func, arg)

    def _unbound(self, func: FuncV, arg: ast.arg) -> Vals:
        name = getattr(func.node, "name", "<lambda>")
        reason = f"`{arg.arg}` is a parameter of `{name}` whose argument is not known here"
        return one(Unknown(reason, suspicious=self._may_be_channel(func, arg.annotation)))

    def _may_be_channel(self, func: FuncV, annotation: ast.expr | None) -> bool:
        if annotation is None:
            return True
        if isinstance(annotation, ast.Constant):
            return "Channel" in str(annotation.value)
        assert isinstance(func.closure, Scope)
        for node in ast.walk(annotation):
            if isinstance(node, ast.Name | ast.Attribute) and not isinstance(node.ctx, ast.Store):
                for v in self.interp.expr.eval(node, func.closure):
                    if is_dynarl(v, "Channel") or isinstance(v, Unknown):
                        return True
        return False


def _is_dispatch(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CHANNEL_OPS
    return (
        isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "getattr"
    )


def _channel(args: Args, node: ast.Call) -> Vals:
    names = args.positional[0] if args.positional else args.keyword("name")
    if names is None:
        return one(Unknown("a channel created without a constant name", suspicious=True))
    text = ast.unparse(node.args[0]) if node.args else "name=..."
    out: set[Value] = set()
    for v in names:
        if isinstance(v, ConstV) and isinstance(v.value, str):
            out.add(ChanV(v.value))
        else:
            out.add(Unknown(f"channel name `{text}` is not a constant", suspicious=True))
    return frozenset(out)


def _range(args: Args) -> Vals:
    bounds = []
    for vals in args.positional:
        if len(vals) != 1 or not isinstance(v := next(iter(vals)), ConstV):
            return plain_unknown("range() with non-constant bounds")
        if not isinstance(v.value, int):
            return plain_unknown("range() with non-int bounds")
        bounds.append(v.value)
    values = range(*bounds)
    if len(values) > 64:
        return plain_unknown("a range too long to unroll")
    return one(SeqV(tuple(one(ConstV(i)) for i in values)))


def _map_method(mapping: MapV, method: str, args: Args) -> Vals:
    if method == "items":
        return one(SeqV(tuple(one(SeqV((one(ConstV(k)), v))) for k, v in mapping.items)))
    if method == "keys":
        return one(SeqV(tuple(one(ConstV(k)) for k, _ in mapping.items)))
    if method == "values":
        return one(SeqV(tuple(v for _, v in mapping.items)))
    keys = args.positional[0] if args.positional else frozenset()
    out: set[Value] = set()
    for key in keys:
        found = mapping.get(key.value) if isinstance(key, ConstV) else None
        if found is None:
            out.add(Unknown("dict.get with a key the extractor cannot resolve", suspicious=True))
        else:
            out |= found
    if len(args.positional) > 1:
        out |= args.positional[1]
    return frozenset(out)
