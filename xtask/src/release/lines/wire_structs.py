"""Print, as JSON, the wire structs a vLLM source tree declares.

Run by `cargo xtask add-line` (xtask/src/lines/): argv[1] is a directory holding the
`vllm/` package (an unpacked wheel or a venv's site-packages). The files are parsed with
`ast`, never imported, so neither vLLM nor its dependencies need to be installed.

Output: {"structs": {name: {file, kind, tagged, fields: [{name, type, default}]}},
         "enums": {name: [[member, value], ...]},
         "methods": {name: [arg, ...]},
         "missing_files": [path, ...]}
`kind` is "array" for msgspec structs with array_like=True (msgpack arrays in field
order), "map" for other msgspec structs and for dataclasses (msgpack maps by name).
A `default` of null means the field is required.
"""

import ast
import json
import os
import sys

# (file under the tree, classes whose fields cross the wire)
STRUCTS = [
    ("vllm/v1/engine/__init__.py", [
        "EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs",
        "UtilityOutput", "EngineCoreEvent", "EngineCoreReadyResponse",
    ]),
    ("vllm/sampling_params.py", ["SamplingParams"]),
    ("vllm/lora/request.py", ["LoRARequest"]),
    ("vllm/pooling_params.py", ["PoolingParams"]),
    ("vllm/v1/metrics/stats.py", ["SchedulerStats", "PrefixCacheStats", "PrefillStats"]),
    ("vllm/outputs.py", ["RequestError"]),
    ("vllm/distributed/kv_events.py", [
        "KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    ]),
]
ENUMS = [
    ("vllm/v1/engine/__init__.py", ["FinishReason", "EngineCoreEventType", "EngineCoreRequestType"]),
]
# Utility calls are dispatched by name to the engine object (EngineCoreProc, a subclass of
# EngineCore): its public methods are the utility surface.
METHODS = ("vllm/v1/engine/core.py", ["EngineCore", "EngineCoreProc"])


def parse(root, rel, missing):
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        missing.append(rel)
        return {}
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=rel)
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def is_dataclass(cls):
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def chain(cls, classes, seen=None):
    """The class and its in-module bases, base first (the order fields are laid out in)."""
    seen = seen or set()
    out = []
    for b in cls.bases:
        name = b.id if isinstance(b, ast.Name) else None
        if name in classes and name not in seen:
            seen.add(name)
            out += chain(classes[name], classes, seen)
    return out + [cls]


def keywords(classes_chain):
    kw = {}
    for c in classes_chain:
        for k in c.keywords:
            if isinstance(k.value, ast.Constant):
                kw[k.arg] = k.value.value
    return kw


def default_of(value):
    if value is None:
        return None
    # msgspec.field(default=X) / dataclasses.field(default_factory=F)
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "field":
            for k in value.keywords:
                if k.arg == "default":
                    return ast.unparse(k.value)
                if k.arg == "default_factory":
                    return ast.unparse(k.value) + "()"
            return None
    return ast.unparse(value)


def fields(cls):
    out = []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        ty = ast.unparse(node.annotation)
        if ty.startswith(("ClassVar", "typing.ClassVar")):
            continue
        out.append({"name": node.target.id, "type": ty, "default": default_of(node.value)})
    return out


def struct(rel, cls, classes):
    cs = chain(cls, classes)
    kw = keywords(cs)
    dataclass = any(is_dataclass(c) for c in cs)
    all_fields = []
    for c in cs:
        for f in fields(c):
            all_fields = [g for g in all_fields if g["name"] != f["name"]] + [f]
    return {
        "file": rel,
        "kind": "array" if kw.get("array_like") and not dataclass else "map",
        "tagged": bool(kw.get("tag")),
        "fields": all_fields,
    }


def enum_members(cls):
    out = []
    for node in cls.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name) and t.id.isupper():
                out.append([t.id, ast.unparse(node.value)])
    return out


def method_args(fn):
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return [n for n in names if n != "self"]


def main():
    root = sys.argv[1]
    missing = []
    out = {"structs": {}, "enums": {}, "methods": {}, "missing_files": missing}
    for rel, names in STRUCTS:
        classes = parse(root, rel, missing)
        for n in names:
            if n in classes:
                out["structs"][n] = struct(rel, classes[n], classes)
    for rel, names in ENUMS:
        classes = parse(root, rel, missing)
        for n in names:
            if n in classes:
                out["enums"][n] = enum_members(classes[n])
    rel, names = METHODS
    classes = parse(root, rel, missing)
    for n in names:
        for node in getattr(classes.get(n), "body", []):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                out["methods"][node.name] = method_args(node)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)


main()
