"""Request validation against an OpenAPI 3.1 document (the Lambda Cloud contract).

simcloud stands in for Lambda Cloud, so it checks that every request the adapter sends is one the real
service documents: the method and path exist, and the JSON body satisfies the operation's requestBody
schema. OpenAPI 3.1 schemas are JSON Schema 2020-12, so `jsonschema` validates them once `$ref`s into
`#/components/...` resolve against the whole document.

`jsonschema` is a dev dependency: it is imported only when a contract is actually loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DOC_URI = "urn:burstctl:openapi"
_HTTP_METHODS = ("get", "post", "put", "patch", "delete")


@dataclass(frozen=True)
class Violation:
    """One request the contract does not allow."""

    method: str
    path: str
    problem: str

    def as_dict(self) -> dict[str, str]:
        return {"method": self.method, "path": self.path, "problem": self.problem}


@dataclass(frozen=True)
class _Operation:
    method: str
    template: str
    pattern: re.Pattern[str]
    body_schema: dict[str, Any] | None
    body_required: bool


class Contract:
    """The operations of one OpenAPI document, able to judge a request."""

    def __init__(self, document: dict[str, Any]):
        from jsonschema import Draft202012Validator
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        self.document = document
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self._registry = Registry().with_resource(_DOC_URI, resource)
        self._validator_cls = Draft202012Validator
        self._validators: dict[tuple[str, str], Any] = {}
        self.operations: list[_Operation] = []
        for template, item in document.get("paths", {}).items():
            for method, op in item.items():
                if method not in _HTTP_METHODS:
                    continue
                body = op.get("requestBody") or {}
                schema = body.get("content", {}).get("application/json", {}).get("schema")
                self.operations.append(_Operation(
                    method=method.upper(), template=template, pattern=_template_regex(template),
                    body_schema=schema, body_required=bool(body.get("required", False)),
                ))

    @classmethod
    def load(cls, path: str | Path) -> Contract:
        with Path(path).open(encoding="utf-8") as fh:
            return cls(json.load(fh))

    def match(self, method: str, path: str) -> _Operation | None:
        # Literal templates win over parameterised ones (/ssh-keys vs /ssh-keys/{id} never clash, but
        # /firewall-rulesets/global vs /firewall-rulesets/{id} do).
        candidates = [op for op in self.operations if op.method == method.upper() and op.pattern.fullmatch(path)]
        candidates.sort(key=lambda op: op.template.count("{"))
        return candidates[0] if candidates else None

    def check(self, method: str, path: str, body: Any) -> str | None:
        """None when the request is allowed; otherwise one line saying what is wrong.

        `body` is the parsed JSON body, or None when the request had none.
        """
        op = self.match(method, path)
        if op is None:
            return f"{method.upper()} {path} is not an operation of the contract"
        if op.body_schema is None:
            return None if body is None else f"{op.method} {op.template} takes no JSON body"
        if body is None:
            return f"{op.method} {op.template} requires a JSON body" if op.body_required else None
        validator = self._validator_for(op)
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        if not errors:
            return None
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(body)"
        return f"{op.method} {op.template}: {where}: {first.message}"

    def check_response(self, method: str, path: str, status: int, body: Any) -> str | None:
        """None when `body` matches the operation's documented JSON response for `status`."""
        op = self.match(method, path)
        if op is None:
            return f"{method.upper()} {path} is not an operation of the contract"
        raw = self.document["paths"][op.template][op.method.lower()]
        response = raw.get("responses", {}).get(str(status))
        if response is None:
            return f"{op.method} {op.template} documents no {status} response"
        schema = response.get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            return None
        validator = self._validator_cls(_rebase_refs(schema), registry=self._registry)
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        if not errors:
            return None
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(body)"
        return f"{op.method} {op.template} {status}: {where}: {errors[0].message}"

    def _validator_for(self, op: _Operation) -> Any:
        key = (op.method, op.template)
        if key not in self._validators:
            schema = _rebase_refs(op.body_schema)
            self._validators[key] = self._validator_cls(schema, registry=self._registry)
        return self._validators[key]


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", template)
    return re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts))


def _rebase_refs(schema: Any) -> Any:
    """Point local `#/...` refs of an operation's schema at the registered whole document."""
    if isinstance(schema, dict):
        return {k: (_DOC_URI + v if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v) for v in schema]
    return schema
