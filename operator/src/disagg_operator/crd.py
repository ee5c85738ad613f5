"""Generate the DisaggServing CustomResourceDefinition from the spec models.

The committed `crds/disaggserving.yaml` is this module's output (a test keeps them equal), so the
schema, its defaults and its CEL rules have one source: `spec.py`.
"""

from __future__ import annotations

from typing import Any

import yaml

from disagg_operator import spec as specs

_CONDITION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "description": "Ready, Progressing, Degraded or "
                 "ConfigWarning."},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string", "description": "One word for why (see Conditions)."},
        "message": {"type": "string", "description": "What is wrong and what to do."},
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "The generation this condition describes."},
        "lastTransitionTime": {"type": "string", "format": "date-time",
                               "description": "When status last changed."},
    },
}

_ROLE_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer", "description": "Desired instances."},
        "readyReplicas": {"type": "integer", "description": "Instances passing readiness."},
        "summary": {"type": "string", "description": "ready/desired, for printing."},
        "selector": {"type": "string", "description": "Label selector of the role's pods "
                     "(the scale subresource's, for HPA)."},
    },
}

_SCALED_ROLE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "desired": {"type": "integer", "description": "Instances the scaler asks for."},
        "current": {"type": "integer", "description": "Instances the workload has now."},
    },
}

_AUTOSCALING_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "mode": {"type": "string", "description": "spec.autoscaling.mode in effect."},
        "prefill": {**_SCALED_ROLE, "description": "Prefill's count."},
        "decode": {**_SCALED_ROLE, "description": "Decode's count."},
        "reason": {"type": "string", "description": "Why the last decision was made."},
        "specIgnored": {"type": "string", "description": "Planner mode: a spec replica count "
                        "changed after the planner started (e.g. kubectl scale), which the "
                        "planner does not follow, and what to do instead."},
        "lastDecisionTime": {"type": "string", "format": "date-time",
                             "description": "When the planner last decided."},
        "load": {"type": "object", "description": "What the last decision saw.",
                 "additionalProperties": {"type": "number"}},
    },
}

# `kubectl scale disaggserving NAME --replicas N` (and an HPA aimed at the DisaggServing)
# scales decode, the role that holds running sequences; each role's Deployment has its own.
SCALE_SUBRESOURCE: dict[str, str] = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.replicas",
    "labelSelectorPath": ".status.decode.selector",
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "The spec generation this status describes."},
        "prefill": {**_ROLE_STATUS, "description": "Prefill instances."},
        "decode": {**_ROLE_STATUS, "description": "Decode instances."},
        "proxy": {**_ROLE_STATUS, "description": "Proxy instances."},
        "endpoint": {"type": "string", "description": "In-cluster URL of the proxy."},
        "autoscaling": {**_AUTOSCALING_STATUS,
                        "description": "The scaler's decision (absent when autoscaling is Off)."},
        "etcd": {
            "type": "object",
            "description": "The etcd the DisaggServing uses, as the operator sees it.",
            "properties": {
                "mode": {"type": "string", "description": "Managed or External."},
                "endpoints": {"type": "array", "items": {"type": "string"},
                              "description": "Client endpoints."},
                "healthy": {"type": "boolean", "description": "The last health check passed."},
                "message": {"type": "string", "description": "The last health check's answer."},
            },
        },
        "conditions": {
            "type": "array",
            "description": "Ready, Progressing, Degraded and ConfigWarning.",
            "items": _CONDITION_SCHEMA,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
     "description": "Ready/desired prefill instances"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
     "description": "Ready/desired decode instances"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Reason", "type": "string", "priority": 1,
     "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def spec_schema() -> dict[str, Any]:
    raw = specs.DisaggServingSpec.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    rules = _cel_rules_by_title()
    return _convert(raw, defs, rules)


def _cel_rules_by_title() -> dict[str, tuple[specs.CelRule, ...]]:
    found: dict[str, tuple[specs.CelRule, ...]] = {}
    pending: list[type[Any]] = [specs.DisaggServingSpec]
    while pending:
        model = pending.pop()
        if model.__name__ in found:
            continue
        found[model.__name__] = model.cel_rules
        for field in model.model_fields.values():
            for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(candidate, type) and issubclass(candidate, specs._Model):
                    pending.append(candidate)
    return {name: rules for name, rules in found.items() if rules}


def _convert(node: dict[str, Any], defs: dict[str, Any],
             rules: dict[str, tuple[specs.CelRule, ...]]) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs, rules)
    if "x-k8s-schema" in node:
        passthrough = dict(node["x-k8s-schema"])
        if "description" in node:
            passthrough["description"] = node["description"]
        return passthrough
    if "anyOf" in node:
        options = [opt for opt in node["anyOf"] if opt.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if node.get("x-kubernetes-int-or-string"):
            int_or_string: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            for key in ("description", "default"):
                if rest.get(key) is not None:
                    int_or_string[key] = rest[key]
            return int_or_string
        if len(options) == 1:
            return _convert({**options[0], **rest}, defs, rules)
        raise ValueError(f"cannot express union {node['anyOf']!r} in a structural schema")

    out: dict[str, Any] = {}
    title = node.get("title")
    # "type" and "description" first keeps the generated YAML readable.
    ordered = sorted(node.items(), key=lambda kv: (kv[0] != "type", kv[0] != "description"))
    for key, value in ordered:
        if key in ("title", "$defs"):
            continue
        if key == "default" and value is None:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out["properties"] = {name: _convert(sub, defs, rules) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, defs, rules)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)
    if title in rules:
        out["x-kubernetes-validations"] = [
            {"rule": r.rule, "message": r.message, **({"fieldPath": r.field_path}
                                                      if r.field_path else {})}
            for r in rules[title]
        ]
    return out


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{specs.PLURAL}.{specs.GROUP}",
            "labels": {"app.kubernetes.io/name": "disagg-operator",
                       "app.kubernetes.io/part-of": "disagg-operator"},
        },
        "spec": {
            "group": specs.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": specs.KIND,
                "listKind": f"{specs.KIND}List",
                "plural": specs.PLURAL,
                "singular": specs.SINGULAR,
                "shortNames": list(specs.SHORT_NAMES),
                "categories": ["disagg"],
            },
            "versions": [{
                "name": specs.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A disaggregated (prefill/decode) vLLM deployment.",
                    "required": ["spec"],
                    "x-kubernetes-validations": [{
                        "rule": f"size(self.metadata.name) <= {specs.MAX_NAME_LENGTH}",
                        "message": f"metadata.name must be at most {specs.MAX_NAME_LENGTH} "
                                   "characters: child object names add up to 16 more",
                    }],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": STATUS_SCHEMA,
                    },
                }},
            }],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):  # type: ignore[misc,unused-ignore]
    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd_yaml() -> str:
    header = "# Generated by `disagg-operator crd` from operator/src/disagg_operator/spec.py.\n"
    body = yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)
    return header + str(body)
