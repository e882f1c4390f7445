"""The JSON-schema subset that xgrammar enforces. A schema keyword xgrammar ignores would let through answers the schema
forbids, silently; such a schema is refused instead, naming the keyword and where it is (as vLLM refuses schemas its
backend cannot enforce). tests/sampling/test_structured.py checks each rule against xgrammar itself, both ways: what is
refused is not enforced, and what is allowed is."""
import re
from urllib.parse import unquote

# Validation keywords xgrammar drops wherever they appear.
IGNORED = {
    "not": "xgrammar does not enforce 'not'",
    "if": "xgrammar does not enforce if/then/else",
    "then": "xgrammar does not enforce if/then/else",
    "else": "xgrammar does not enforce if/then/else",
    "dependentRequired": "xgrammar does not enforce dependentRequired",
    "dependentSchemas": "xgrammar does not enforce dependentSchemas",
    "dependencies": "xgrammar does not enforce dependencies",
    "contains": "xgrammar does not enforce contains (nor minContains/maxContains)",
    "minContains": "xgrammar does not enforce minContains",
    "maxContains": "xgrammar does not enforce maxContains",
    "$dynamicRef": "xgrammar does not follow $dynamicRef (it lets any value through); use a local $ref",
    "$recursiveRef": "xgrammar does not follow $recursiveRef (it lets any value through); use a local $ref",
}
# Words that describe a schema and constrain nothing; allowed beside $ref and the combinators.
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator", "nullable", "contentEncoding",
               "contentMediaType", "contentSchema"}
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
NUMBER_WORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_WORDS = ("minLength", "maxLength", "pattern", "format")
# Array and object keywords xgrammar drops where it does not know the value is an array or object: without "type", it
# takes the node for one only from the keywords beside them listed here, and otherwise lets any JSON value through
ARRAY_WORDS, ARRAY_SHAPES = ("minItems", "maxItems"), ("items", "prefixItems", "unevaluatedItems")
OBJECT_WORDS = ("minProperties", "maxProperties", "patternProperties", "propertyNames")
OBJECT_SHAPES = ("properties", "additionalProperties", "unevaluatedProperties")
# The string formats xgrammar turns into a grammar; any other format ("phone", "regex", "iri", ...) it lets every
# string through for
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer"}
# formats that allow every string (pydantic's SecretStr, bytes and Path): nothing for xgrammar to enforce
ANY_STRING_FORMATS = {"password", "binary", "path"}
# regex features xgrammar's JSON pattern reader takes as literal characters or cannot parse
_PATTERN_UNSUPPORTED = re.compile(r"\(\?<?[=!]|\\[bB1-9]")
_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
             "array": (list,), "object": (dict,)}


def check_schema(schema: dict) -> None:
    """ValueError naming the first keyword of `schema` that xgrammar would not enforce, and what to change."""
    _check(schema, schema, "#")


def _fail(path: str, why: str):
    raise ValueError(f"structured_outputs.json: {why} (at {path}); answers could break the schema, so it is refused. "
                     "Remove or rewrite that part of the schema")


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _is_instance(value, type_name: str) -> bool:
    if type_name in ("integer", "number") and isinstance(value, bool):
        return False
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PY_TYPES.get(type_name, object))


def _resolve(root: dict, node):
    """A local $ref followed (to tell oneOf branches apart); the node itself otherwise."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") and seen < 32:
        target = root
        for part in node["$ref"][2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")  # (a URI fragment: %24defs is $defs)
            target = target.get(part) if isinstance(target, dict) else None
        node, seen = target, seen + 1
    return node


def _disjoint(root: dict, branches: list) -> bool:
    """Whether no value can match two of the oneOf branches (then anyOf, which xgrammar enforces, is the same): by
    type, by const/enum values, or by a required property whose const/enum values differ (a discriminator)."""
    nodes = [_resolve(root, b) for b in branches]
    if not all(isinstance(n, dict) for n in nodes):
        return False
    types = [_types(n) | ({"number"} if "integer" in _types(n) else set()) for n in nodes]
    if all(types) and all(not a & b for i, a in enumerate(types) for b in types[i + 1:]):
        return True

    def values(n) -> list | None:
        return [n["const"]] if "const" in n else n["enum"] if isinstance(n.get("enum"), list) else None
    vals = [values(n) for n in nodes]
    if all(v is not None for v in vals):
        flat = [repr(v) for vs in vals for v in vs]
        return len(flat) == len(set(flat))
    common = set.intersection(*(set(n.get("required", [])) for n in nodes)) if nodes else set()
    for key in common:
        props = [_resolve(root, n.get("properties", {}).get(key)) for n in nodes]
        if all(isinstance(p, dict) for p in props):
            vals = [values(p) for p in props]
            if all(v is not None for v in vals):
                flat = [repr(v) for vs in vals for v in vs]
                if len(flat) == len(set(flat)):
                    return True
    return False


def _check(root: dict, node, path: str):
    if isinstance(node, bool) or not isinstance(node, dict):
        return  # true/false schemas: xgrammar takes them (or refuses false itself, at compile time)
    for key in node:
        if key in IGNORED:
            _fail(f"{path}/{key}", IGNORED[key])
    if node.get("uniqueItems") is True:
        _fail(f"{path}/uniqueItems", "xgrammar does not enforce uniqueItems")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        _fail(f"{path}/$ref", f"xgrammar follows only a local $ref ('#' or '#/...'), and lets any value through "
              f"for {ref!r:.60}; put the schema under $defs and refer to it as '#/$defs/...'")
    combinators = [k for k in COMBINATORS if k in node]
    if combinators:
        siblings = sorted(k for k in node if k not in ANNOTATIONS and k not in COMBINATORS)
        if siblings or len(combinators) > 1:
            _fail(f"{path}/{combinators[0]}", f"xgrammar enforces {combinators[0]} alone and ignores "
                  f"{', '.join(siblings + combinators[1:])} beside it; move those into each branch")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        _fail(f"{path}/allOf", "xgrammar does not combine the schemas of an allOf; merge them into one schema")
    if isinstance(node.get("oneOf"), list) and not _disjoint(root, node["oneOf"]):
        _fail(f"{path}/oneOf", "xgrammar enforces oneOf as anyOf, and these branches may overlap (a value matching "
              "two of them breaks oneOf); use anyOf if that is fine, or make the branches differ in type or in a "
              "const property")
    types = _types(node)
    for key in NUMBER_WORDS:
        if key in node and not types & {"integer", "number"}:
            _fail(f"{path}/{key}", f"xgrammar enforces {key} only beside \"type\": \"integer\" or \"number\"")
    for words, shapes, kind in ((ARRAY_WORDS, ARRAY_SHAPES, "array"), (OBJECT_WORDS, OBJECT_SHAPES, "object")):
        for key in words:
            # (beside another type the keyword never applies, and xgrammar's answer is the schema's)
            if key in node and not types and not any(k in node for k in shapes):
                _fail(f"{path}/{key}", f"xgrammar enforces {key} only beside \"type\": \"{kind}\" (or "
                      f"{'/'.join(shapes)}), and lets any value through here")
    if "multipleOf" in node and types & {"number"}:
        _fail(f"{path}/multipleOf", "xgrammar enforces multipleOf for integers only; use \"type\": \"integer\"")
    for key in STRING_WORDS:
        if key in node and "string" not in types:
            _fail(f"{path}/{key}", f"xgrammar enforces {key} only beside \"type\": \"string\"")
    shapes = [k for k in ("pattern", "format") if k in node] + \
        (["minLength/maxLength"] if "minLength" in node or "maxLength" in node else [])
    if len(shapes) > 1:
        _fail(f"{path}/{shapes[0]}", f"xgrammar enforces one of pattern, format and minLength/maxLength and ignores "
              f"the others; here {' and '.join(shapes)} (put the length into the pattern)")
    if "format" in node and (not isinstance(node["format"], str) or node["format"] not in FORMATS | ANY_STRING_FORMATS):
        _fail(f"{path}/format", f"xgrammar does not enforce format {node['format']!r:.40} (only "
              f"{', '.join(sorted(FORMATS))}); use a pattern instead")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _PATTERN_UNSUPPORTED.search(pattern):
        _fail(f"{path}/pattern", "xgrammar cannot enforce lookaround, word boundaries or backreferences in a pattern")
    for key in ("enum", "const"):
        others = sorted(k for k in node if k not in ANNOTATIONS and k not in ("type", "enum", "const"))
        if key in node and others:
            _fail(f"{path}/{key}", f"xgrammar enforces {key} alone and ignores {', '.join(others)} beside it; "
                  f"list only the values that satisfy them")
        if key in node and types:
            values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
            for value in values:
                if not any(_is_instance(value, t) for t in types):
                    _fail(f"{path}/{key}", f"{key} value {value!r:.40} is not of the type {sorted(types)} beside it, "
                          "and xgrammar would allow it anyway; drop the value or fix the type")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:
            _fail(f"{path}/required", f"required property {missing[0]!r} is not under properties, and xgrammar would "
                  "not require it; add it to properties")
    # the subschemas
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check(root, sub, f"{path}/{key}/{name}")
    for key in ("items", "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties"):
        if key in node:
            _check(root, node[key], f"{path}/{key}")
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check(root, sub, f"{path}/{key}/{i}")
