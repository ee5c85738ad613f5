"""Every example DisaggServing is valid against the CRD's own OpenAPI schema (with the API
server's defaulting) and against the operator's checks, so a bad example fails CI."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from disagg_devtools.emulator.server import apply_schema_defaults, plain_schema
from disagg_operator.crd import build_crd
from disagg_operator.spec import parse_spec, spec_warnings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid_with_defaults(example: Path) -> None:
    doc = yaml.safe_load(example.read_text())
    defaulted = apply_schema_defaults(SCHEMA, doc)
    body = {k: v for k, v in defaulted.items() if k != "metadata"}
    jsonschema.Draft4Validator(plain_schema(SCHEMA)).validate(body)
    spec = parse_spec(defaulted["spec"])  # the operator's cross-field (CEL-mirroring) checks
    assert spec.model.kv_heads is not None  # so the operator checks its TP sizes up front
    assert spec_warnings(spec) == []


def test_the_check_catches_a_bad_example() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "llama-1p1d.yaml").read_text())
    doc["spec"]["model"]["blockSize"] = 17
    defaulted = apply_schema_defaults(SCHEMA, doc)
    with pytest.raises(jsonschema.ValidationError, match="17"):
        jsonschema.Draft4Validator(plain_schema(SCHEMA)).validate(
            {k: v for k, v in defaulted.items() if k != "metadata"})
