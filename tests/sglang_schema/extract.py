"""Extract SGLang's HTTP request schema from a wheel, by reading its source with ``ast``.

Never imports sglang (its import pulls CUDA torch). Reads, from the wheel given:

- ``sglang/srt/managers/io_struct.py``: the request classes the native endpoints decode
  (msgspec Structs, whose base ``BaseReq`` fields are merged in, and the
  ``GenerateReqInput`` dataclass), as ``{field: default}``;
- ``sglang/api/v1/api_types.py``: the ``/generate`` JSON contract gate
  (``GenerateRequest`` and ``SamplingParams``, whose unknown keys are refused);
- ``sglang/srt/managers/load_snapshot.py``: the ``/v1/loads`` ``LoadSnapshot`` and sections;
- ``sglang/srt/entrypoints/http_server.py`` and ``v1_loads.py``: each route's methods, body
  class and auth level.

A default is written as ``repr`` of its literal value (``"None"``, ``"'abort'"``, ``"{}"``),
``"<required>"`` when there is none, ``"factory:<callable>"`` for a default factory, and
``"expr:<source>"`` for anything that is not a literal.

Run as a script to (re)write the committed snapshot::

    .venv/bin/python tests/sglang_schema/extract.py --wheel WHEEL \\
        --out tests/sglang_schema/sglang-0.5.23.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import re
import zipfile
from typing import Any

IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
LOAD_SNAPSHOT = "sglang/srt/managers/load_snapshot.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
V1_LOADS = "sglang/srt/entrypoints/v1_loads.py"

IO_CLASSES = (
    "GenerateReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "AbortReq",
    "FlushCacheReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "InitWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "BeginWeightUpdateReqInput",
    "EndWeightUpdateReqInput",
    "CheckWeightsReqInput",
    "UpdateWeightVersionReqInput",
)
API_CLASSES = ("GenerateRequest", "SamplingParams")
LOAD_CLASSES = ("LoadSnapshot", "MemoryMetrics", "QueueMetrics")
ROUTES = (
    "/health",
    "/health_generate",
    "/ready",
    "/model_info",
    "/generate",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weight_version",
    "/weights_checker",
    "/v1/loads",
)
_ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"]}


def _default_text(node: ast.expr | None) -> str:
    if node is None:
        return "<required>"
    if isinstance(node, ast.Call):
        callee = ast.unparse(node.func)
        if callee in ("field", "dataclasses.field", "msgspec.field"):
            for keyword in node.keywords:
                if keyword.arg == "default":
                    return _default_text(keyword.value)
                if keyword.arg == "default_factory":
                    return f"factory:{ast.unparse(keyword.value)}"
            return "<required>"
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return f"expr:{ast.unparse(node)}"


def _own_fields(cls: ast.ClassDef) -> dict[str, str]:
    fields: dict[str, str] = {}
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
            if name.isupper() or ast.unparse(statement.annotation).startswith("ClassVar"):
                continue
            fields[name] = _default_text(statement.value)
    return fields


def _class_fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, str]:
    """Fields of ``name`` with those of its same-module bases first (msgspec order)."""
    cls = classes[name]
    fields: dict[str, str] = {}
    for base in cls.bases:
        base_name = ast.unparse(base)
        if base_name in classes:
            fields.update(_class_fields(classes, base_name))
    fields.update(_own_fields(cls))
    return fields


def _classes(source: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse(source)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _route_info(func: ast.AsyncFunctionDef | ast.FunctionDef) -> list[tuple[str, dict[str, Any]]]:
    paths: list[tuple[str, list[str]]] = []
    auth = "NORMAL"
    for decorator in func.decorator_list:
        if not isinstance(decorator, ast.Call) or not isinstance(decorator.func, ast.Attribute):
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "auth_level":
                auth = ast.unparse(decorator.args[0]).rsplit(".", 1)[-1]
            continue
        attr = decorator.func.attr
        if attr not in (*_ROUTE_DECORATORS, "api_route") or not decorator.args:
            continue
        if not isinstance(decorator.args[0], ast.Constant):
            continue
        methods = _ROUTE_DECORATORS.get(attr, [])
        for keyword in decorator.keywords:
            if keyword.arg == "methods":
                methods = list(ast.literal_eval(keyword.value))
        paths.append((str(decorator.args[0].value), methods))
    body_class: str | None = None
    body_optional = False
    query: dict[str, str] = {}
    positional = func.args.args
    defaults = [None] * (len(positional) - len(func.args.defaults)) + list(func.args.defaults)
    for arg, default in zip(positional, defaults, strict=True):
        annotation = ast.unparse(arg.annotation) if arg.annotation else ""
        match = re.fullmatch(r"Annotated\[(Optional\[)?(\w+)\]?, Body\(\)\]", annotation)
        if match:
            body_class, body_optional = match.group(2), bool(match.group(1))
        elif annotation.endswith("ReqInput") or annotation.endswith("Req"):
            body_class = annotation
        elif annotation in ("int", "float", "str", "bool", "Optional[int]", "Optional[str]"):
            if default is not None and isinstance(default, ast.Call) and default.args:
                query[arg.arg] = _default_text(default.args[0])
            else:
                query[arg.arg] = _default_text(default)
    info = {"body": body_class, "body_optional": body_optional, "query": query, "auth": auth}
    return [(path, {"methods": sorted(methods), **info}) for path, methods in paths]


def _routes(*sources: str) -> dict[str, dict[str, Any]]:
    routes: dict[str, dict[str, Any]] = {}
    for source in sources:
        for node in ast.parse(source).body:
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                for path, info in _route_info(node):
                    if path in ROUTES:
                        known = routes.get(path)
                        if known is not None:
                            info["methods"] = sorted({*known["methods"], *info["methods"]})
                        routes[path] = info
    return dict(sorted(routes.items()))


def _version(names: list[str], archive: zipfile.ZipFile) -> str:
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    for line in archive.read(metadata).decode().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise ValueError(f"no Version in {metadata}")


def extract_schema(wheel: pathlib.Path) -> dict[str, Any]:
    """The request schema of the SGLang wheel at ``wheel``, as a JSON-ready dict."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        read = {name: archive.read(name).decode() for name in (IO_STRUCT, API_TYPES, LOAD_SNAPSHOT)}
        http_server = archive.read(HTTP_SERVER).decode()
        v1_loads = archive.read(V1_LOADS).decode()
        version = _version(names, archive)
    io_classes = _classes(read[IO_STRUCT])
    api_classes = _classes(read[API_TYPES])
    load_classes = _classes(read[LOAD_SNAPSHOT])
    return {
        "sglang_version": version,
        "io_struct": {name: _class_fields(io_classes, name) for name in IO_CLASSES},
        "api_contract": {name: _class_fields(api_classes, name) for name in API_CLASSES},
        "load_snapshot": {name: _class_fields(load_classes, name) for name in LOAD_CLASSES},
        "routes": _routes(http_server, v1_loads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    schema = extract_schema(args.wheel)
    schema["wheel_sha256"] = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
