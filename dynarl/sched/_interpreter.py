"""A small abstract interpreter over user sources, for the graph extractor.

Statements run in order (flow-sensitive), branches run on copies of the scope that are
then joined, loops over sequences of known length are unrolled, calls to analysed
functions are inlined with their arguments bound (so helpers, wrappers and decorators
resolve), and ``getattr`` with a constant name is an attribute. What it cannot resolve
becomes :class:`~dynarl.sched._symbols.Unknown` with a reason; a channel operation on a
suspicious unknown is recorded as an unresolved site. Every walk is bounded (unrolling,
call depth, value-set size), so it terminates on any input.
"""

from __future__ import annotations

import ast
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from dynarl.sched._calls import Calls
from dynarl.sched._expressions import Expressions
from dynarl.sched._symbols import (
    Args,
    ClassV,
    ConstV,
    Ext,
    FuncV,
    InstanceV,
    Instantiation,
    Mod,
    ModuleSource,
    Scope,
    Sink,
    Site,
    Unknown,
    Vals,
    Value,
    cap,
    is_dynarl,
    one,
    parse,
    plain_unknown,
    truth,
    unpack,
)

__all__ = ["ClassInfo", "Interpreter"]


MAX_DEPTH = 24
"""Deepest chain of inlined calls."""
MAX_CONTEXTS = 32
"""Distinct argument contexts per function and round before its arguments are widened."""
MAX_STEPS = 2_000_000
"""Statements one extraction may interpret before it stops following calls."""


@dataclass(slots=True)
class ClassInfo:
    """What executing a ``class`` statement produced."""

    value: ClassV
    bases: tuple[Vals, ...]
    namespace: dict[str, Vals]
    closure: Scope


class Interpreter:
    """Runs the abstract interpretation of a set of modules (see the module docstring)."""

    def __init__(self, modules: list[ModuleSource]) -> None:
        self.sources = {m.name: m for m in modules}
        self.trees = {m.name: parse(m) for m in modules}
        self.module_scopes: dict[str, Scope] = {}
        self.classes: dict[ast.ClassDef, ClassInfo] = {}
        self.instantiations: list[Instantiation] = []
        self.stores: dict[Hashable, dict[str, Vals]] = {}
        self.issues: set[tuple[Site, str]] = set()
        self.invoked: set[ast.AST] = set()
        self.memo: dict[Hashable, tuple[Vals, Sink]] = {}
        self.active: set[Hashable] = set()
        self.sink = Sink()
        self.changed = False
        self.recording = True
        self._depth = 0
        self._contexts: dict[tuple[ast.AST, InstanceV | None], set[Args]] = {}
        self._exhausted = False
        self.steps = 0
        self.expr = Expressions(self)
        self.calls = Calls(self)

    def new_round(self) -> None:
        """Forget memoised calls and call contexts (the attribute stores changed)."""
        self.memo.clear()
        self._contexts.clear()

    # ------------------------------------------------------------------ modules
    def site(self, scope: Scope, node: ast.AST) -> Site:
        """Where ``node`` is, for reports."""
        return Site(self.sources[scope.module].file, getattr(node, "lineno", 0))

    def module_scope(self, name: str) -> Scope | None:
        """The global scope of module ``name``, executing it first if needed."""
        if name in self.module_scopes:
            return self.module_scopes[name]
        if name not in self.trees:
            return None
        if "." in name:
            self.module_scope(name.rsplit(".", 1)[0])
        scope = Scope(name, None)
        scope.names["__name__"] = plain_unknown("the module's __name__")
        self.module_scopes[name] = scope
        self.exec_block(self.trees[name].body, scope)
        return scope

    def _is_internal(self, name: str) -> bool:
        return name in self.trees or any(m.startswith(name + ".") for m in self.trees)

    def module_value(self, name: str) -> Vals:
        """``import name`` as a value."""
        if self._is_internal(name):
            self.module_scope(name)
            return one(Mod(name))
        return one(Ext(name))

    def import_name(self, base: str, name: str) -> Vals:
        """``from base import name`` (or ``base.name`` on a module)."""
        if not self._is_internal(base):
            return one(Ext(f"{base}.{name}"))
        scope = self.module_scope(base)
        if scope is not None and name in scope.names:
            return scope.names[name]
        if self._is_internal(f"{base}.{name}"):
            return self.module_value(f"{base}.{name}")
        return one(Unknown(f"`{name}` is not defined in module `{base}`", suspicious=True))

    def _from_base(self, scope: Scope, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = scope.module.split(".")
        if not self.sources[scope.module].is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join([*parts, node.module] if node.module else parts)

    # --------------------------------------------------------------- statements
    def exec_block(self, body: Iterable[ast.stmt], scope: Scope) -> None:
        """Execute statements in order."""
        for stmt in body:
            self.exec_stmt(stmt, scope)

    def exec_branches(self, scope: Scope, bodies: Iterable[Iterable[ast.stmt]]) -> None:
        """Execute alternative bodies on copies of ``scope`` and join them into it."""
        forks = []
        for body in bodies:
            fork = scope.fork()
            self.exec_block(body, fork)
            forks.append(fork)
        scope.join(forks)

    def exec_stmt(self, stmt: ast.stmt, scope: Scope) -> None:
        """Execute one statement."""
        self.steps += 1
        ev = self.expr.eval
        match stmt:
            case ast.Expr(value=value):
                if not self.expr.mutation(value, scope):
                    ev(value, scope)
            case ast.Assign(targets=targets, value=value):
                vals = ev(value, scope)
                for target in targets:
                    self.assign(target, vals, scope)
            case ast.AnnAssign(target=target, value=value) if value is not None:
                self.assign(target, ev(value, scope), scope)
            case ast.AugAssign(target=target, value=value):
                ev(value, scope)
                if isinstance(target, ast.Name):
                    scope.names[target.id] = plain_unknown("augmented assignment")
            case ast.Return(value=value):
                scope.returns.update(ev(value, scope) if value else one(ConstV(None)))
            case ast.If(test=test, body=body, orelse=orelse):
                known = truth(ev(test, scope))
                if known is None:
                    self.exec_branches(scope, (body, orelse))
                else:
                    self.exec_block(body if known else orelse, scope)
            case ast.For() | ast.AsyncFor():
                self._exec_for(stmt, scope)
            case ast.While(test=test, body=body, orelse=orelse):
                ev(test, scope)
                self.exec_branches(scope, (body, ()))
                self.exec_block(orelse, scope)
            case ast.With() | ast.AsyncWith():
                for item in stmt.items:
                    vals = ev(item.context_expr, scope)
                    if item.optional_vars is not None:
                        self.assign(item.optional_vars, vals, scope)
                self.exec_block(stmt.body, scope)
            case ast.Try() | ast.TryStar():
                self.exec_block(stmt.body, scope)
                self.exec_branches(scope, [h.body for h in stmt.handlers] + [stmt.orelse])
                self.exec_block(stmt.finalbody, scope)
            case ast.Match(subject=subject, cases=cases):
                ev(subject, scope)
                self.exec_branches(scope, [case.body for case in cases] + [[]])
            case ast.FunctionDef() | ast.AsyncFunctionDef():
                closure = scope.parent if scope.is_class and scope.parent else scope
                owner = scope.owner if scope.is_class else None
                func = FuncV(scope.module, stmt, closure, owner=owner)
                scope.names[stmt.name] = one(func)
            case ast.ClassDef():
                self._exec_class(stmt, scope)
            case ast.Import(names=names):
                for alias in names:
                    imported = self.module_value(alias.name)
                    top = alias.name.split(".")[0]
                    scope.names[alias.asname or top] = (
                        imported if alias.asname else self.module_value(top)
                    )
            case ast.ImportFrom(names=names):
                base = self._from_base(scope, stmt)
                for alias in names:
                    if alias.name == "*":
                        source = self.module_scope(base)
                        for name, vals in (source.names if source else {}).items():
                            if not name.startswith("_"):
                                scope.names[name] = vals
                    else:
                        scope.names[alias.asname or alias.name] = self.import_name(base, alias.name)
            case _:
                for child in ast.iter_child_nodes(stmt):
                    if isinstance(child, ast.expr):
                        ev(child, scope)

    def _exec_for(self, stmt: ast.For | ast.AsyncFor, scope: Scope) -> None:
        iterable = self.expr.iterate(self.expr.eval(stmt.iter, scope))
        if iterable is not None:
            forks = []
            for items in iterable:
                fork = scope.fork()
                for item in items:
                    self.assign(stmt.target, item, fork)
                    self.exec_block(stmt.body, fork)
                forks.append(fork)
            scope.join(forks)
        else:
            fork = scope.fork()
            reason = f"loop variable over `{ast.unparse(stmt.iter)}`, which is not enumerable"
            self.assign(stmt.target, one(Unknown(reason, suspicious=True)), fork)
            self.exec_block(stmt.body, fork)
            scope.join((scope.fork(), fork))
        self.exec_block(stmt.orelse, scope)

    def _exec_class(self, node: ast.ClassDef, scope: Scope) -> None:
        value = ClassV(scope.module, node)
        bases = tuple(self.expr.eval(base, scope) for base in node.bases)
        for base, vals in zip(node.bases, bases, strict=True):
            for v in vals:
                if isinstance(v, Unknown):
                    text = f"base `{ast.unparse(base)}` of class `{node.name}` is unresolved"
                    self.issues.add((self.site(scope, node), f"{text}: {v.reason}"))
        body = Scope(scope.module, scope, is_class=True, owner=value)
        self.exec_block(node.body, body)
        closure = scope.parent if scope.is_class and scope.parent else scope
        self.classes[node] = ClassInfo(value, bases, body.names, closure)
        scope.names[node.name] = one(value)

    def assign(self, target: ast.expr, vals: Vals, scope: Scope) -> None:
        """Bind ``vals`` to an assignment target."""
        match target:
            case ast.Name(id=name):
                scope.names[name] = cap(vals)
            case ast.Tuple(elts=elts) | ast.List(elts=elts):
                for index, elt in enumerate(elts):
                    self.assign(elt, unpack(vals, index, len(elts)), scope)
            case ast.Starred(value=value):
                self.assign(value, plain_unknown("starred assignment"), scope)
            case ast.Attribute(value=obj, attr=attr):
                for holder in self.expr.eval(obj, scope):
                    if isinstance(holder, InstanceV):
                        self.store(holder, attr, vals)
                    elif isinstance(holder, ClassV) and holder.node in self.classes:
                        namespace = self.classes[holder.node].namespace
                        namespace[attr] = cap(namespace.get(attr, frozenset()) | vals)
            case ast.Subscript(value=obj, slice=key):
                updated = self.expr.with_item(self.expr.eval(obj, scope), key, vals, scope)
                if updated is not None:
                    self.assign(obj, updated, scope)

    def store(self, instance: InstanceV, attr: str, vals: Vals) -> None:
        """Add ``vals`` to an instance attribute (attribute stores are flow-insensitive)."""
        store = self.stores.setdefault(instance.key, {})
        old = store.get(attr, frozenset())
        new = cap(old | vals)
        if new != old:
            store[attr] = new
            self.changed = True

    # -------------------------------------------------------------------- calls
    def invoke(self, func: FuncV, args: Args, site: Site) -> Vals:
        """Inline a call of an analysed function; its findings go to the current sink.

        A function called in more than ``MAX_CONTEXTS`` distinct argument contexts (per
        round) is analysed once more with unknown arguments and that result is reused.
        Once the statement budget is spent, calls are no longer inlined and the first
        such call is reported as an unresolved site.
        """
        key: tuple[FuncV, Args] = (func, args)
        self.invoked.add(func.node)
        if key in self.active or self._depth >= MAX_DEPTH:
            return plain_unknown("recursive call")
        if key not in self.memo:
            contexts = self._contexts.setdefault((func.node, func.self_), set())
            contexts.add(args)
            if len(contexts) > MAX_CONTEXTS:
                key = (func, Args(open=True))
        if key not in self.memo and self.steps >= MAX_STEPS:
            if not self._exhausted:
                self._exhausted = True
                reason = (
                    f"analysis budget of {MAX_STEPS} statements spent; "
                    "calls from here on are not followed"
                )
                self.issues.add((site, reason))
                self.sink.unresolved.add((site, reason))
            return plain_unknown("analysis budget spent")
        args = key[1]
        if key in self.memo:
            result, found = self.memo[key]
            self.sink.merge(found)
            return result
        outer, self.sink = self.sink, Sink()
        self.active.add(key)
        self._depth += 1
        try:
            assert isinstance(func.closure, Scope)
            scope = Scope(func.module, func.closure, owner=func.owner, self_=func.self_)
            scope.names.update(self.calls.bind(func, args))
            if isinstance(func.node, ast.Lambda):
                result = self.expr.eval(func.node.body, scope)
            else:
                self.exec_block(func.node.body, scope)
                result = cap(scope.returns) if scope.returns else one(ConstV(None))
        finally:
            found, self.sink = self.sink, outer
            self.active.discard(key)
            self._depth -= 1
        self.memo[key] = (result, found)
        outer.merge(found)
        return result

    def mro(self, cls: ClassV) -> tuple[list[ClassV], list[Ext | Unknown]]:
        """Analysed classes in method-resolution order, and the external bases met."""
        order: list[ClassV] = []
        external: list[Ext | Unknown] = []
        pending = [cls]
        while pending:
            current = pending.pop(0)
            if current in order or current.node not in self.classes:
                continue
            order.append(current)
            for vals in self.classes[current.node].bases:
                for base in sorted(vals, key=repr):
                    if isinstance(base, ClassV):
                        pending.append(base)
                    elif isinstance(base, Ext | Unknown):
                        external.append(base)
        return order, external

    def is_component(self, cls: ClassV) -> bool:
        """Whether ``cls`` derives dynarl's WorkerGroup."""
        return any(is_dynarl(base, "WorkerGroup") for base in self.mro(cls)[1])

    def class_attr(
        self, cls: ClassV, attr: str, bound: InstanceV | None, *, fallback: bool = True
    ) -> Vals | None:
        """``cls.attr`` (methods bound to ``bound``), searching the analysed bases.

        Without ``fallback`` an attribute no analysed class defines is None; with it, one
        that may come from an external base is a suspicious unknown.
        """
        order, external = self.mro(cls)
        for current in order:
            namespace = self.classes[current.node].namespace
            if attr in namespace:
                return frozenset(_bind(v, bound) for v in namespace[attr])
        if fallback and external and attr != "__init__":
            reason = f"`{attr}` comes from base `{_describe(external[0])}`, which is not analysed"
            return one(Unknown(reason, suspicious=True))
        return None

    def instantiate(self, cls: ClassV, args: Args, site: Site) -> Vals:
        """``cls(*args)``: record a component, or build an analysed object."""
        if self.is_component(cls):
            if self.recording:
                self.instantiations.append(Instantiation(cls, args, site))
            return plain_unknown("a component handle")
        key = ("object", cls.node, args)
        instance = InstanceV(cls, key)
        if key not in self.stores:
            self.stores[key] = {}
            init = self.class_attr(cls, "__init__", bound=instance)
            funcs = [v for v in init or () if isinstance(v, FuncV)]
            for func in funcs:
                self.invoke(func, args, site)
            if not funcs:
                self._init_fields(cls, instance, args)
        return one(instance)

    def _init_fields(self, cls: ClassV, instance: InstanceV, args: Args) -> None:
        """A dataclass-like ``__init__``: arguments bind to annotated fields in order."""
        fields = [
            s.target.id
            for s in cls.node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        ]
        for name, vals in zip(fields, args.positional, strict=False):
            self.store(instance, name, vals)
        for name, vals in args.keywords:
            if name in fields:
                self.store(instance, name, vals)


def _bind(value: Value, bound: InstanceV | None) -> Value:
    if bound is None or not isinstance(value, FuncV) or value.self_ is not None:
        return value
    if isinstance(value.node, ast.Lambda):
        return value
    decorators = {ast.unparse(d) for d in value.node.decorator_list}
    if decorators & {"staticmethod", "classmethod"}:
        return value
    return FuncV(value.module, value.node, value.closure, self_=bound, owner=value.owner)


def _describe(value: Ext | Unknown) -> str:
    return value.path if isinstance(value, Ext) else value.reason
