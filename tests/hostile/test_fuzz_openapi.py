"""Property-based fuzzing of the HTTP API through the OpenAPI document it serves.

schemathesis reads ``GET /v1/openapi.json`` from a real ``rdq dev`` subprocess (loopback, free
port, bearer token) and generates requests for every operation, both schema-valid (positive) and
schema-violating (negative). For every response:

* never a 5xx, and every 4xx is ``application/problem+json`` with a body that says the same status;
* the status code, content type and body conform to the document (schemathesis' own checks);
* negative requests are refused with a 4xx, and positive requests are accepted: a schema-valid
  request may only be refused for a reason the schema cannot state (an unknown task 404, a state
  conflict 409, a cursor the server never issued 400). A 422 for schema-valid input means the
  document is inaccurate, which is a bug.

Bounded: ``RDQ_FUZZ_EXAMPLES`` examples per operation and mode (default 40) and a ~60 s budget;
derandomized (reproducible in CI) unless ``RDQ_FUZZ_RANDOM=1``.
"""

from __future__ import annotations

import json
import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 - after importorskip
from schemathesis import GenerationMode  # noqa: E402 - after importorskip
from schemathesis.checks import (  # noqa: E402 - after importorskip
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import PROBLEM_JSON, TOKEN  # noqa: E402 - after importorskip

EXAMPLES = int(os.environ.get("RDQ_FUZZ_EXAMPLES", "40"))
BUDGET_SECONDS = float(os.environ.get("RDQ_FUZZ_BUDGET_SECONDS", "60"))
#: Statuses a schema-valid request may still get, each for a reason no schema can express.
POSITIVE_REFUSALS = {404: "unknown task", 409: "state conflict"}


def _header(response, name: str) -> str:
    for key, value in response.headers.items():
        if key.lower() == name:
            return value[0] if isinstance(value, list) else value
    return ""


def _check_response(case, response, mode: GenerationMode) -> None:
    status = response.status_code
    body = response.content
    where = f"{case.method} {case.formatted_path} -> {status}: {body[:300]!r}\n{case.as_curl_command()}"
    assert status < 500, where
    if status >= 400:
        content_type = _header(response, "content-type").split(";")[0].strip()
        assert content_type == PROBLEM_JSON, where
        problem = json.loads(body)
        assert problem["status"] == status and problem["type"].startswith("urn:rdq:problem:"), where
        if mode is GenerationMode.POSITIVE:
            cursor_refused = status == 400 and problem.get("field") == "cursor"
            # "ids unique within a batch" is a rule on a property of the items: JSON Schema's uniqueItems
            # cannot state it, so the document says it in words.
            duplicate_id = status == 422 and "appears twice in the batch" in problem["detail"]
            assert status in POSITIVE_REFUSALS or cursor_refused or duplicate_id, "schema-valid request refused: " + where


def _violation_not_sent(schema, case) -> bool:
    """True when the case's only schema violation is an undeclared query parameter whose value
    is an empty list or None: the HTTP client drops it, so the request actually sent is valid and
    "accepted" is the right answer (schemathesis would still count it as a negative case)."""
    operation = schema.raw_schema["paths"][case.operation.path][case.method.lower()]
    declared = {p["name"] for p in operation.get("parameters", []) if p.get("in") == "query"}
    unknown = {k: v for k, v in (case.query or {}).items() if k not in declared}
    return bool(unknown) and all(v in (None, []) for v in unknown.values())


@pytest.mark.timeout(180)
def test_fuzz_every_operation_of_the_served_openapi_document(dev_server):
    schema = schemathesis.openapi.from_url(f"{dev_server.url}/v1/openapi.json",
                                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert schema.raw_schema["openapi"].startswith("3.1")
    operations = [result.ok() for result in schema.get_all_operations()]
    # Every operation of the route table but the document itself.
    from rdq_core.hosts.aws_lambda.routes import ROUTES

    assert len(operations) == len(ROUTES) - 1, [op.label for op in operations]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance]
    deadline = time.monotonic() + BUDGET_SECONDS
    counts: dict[str, int] = {}
    fuzz_settings = settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=os.environ.get("RDQ_FUZZ_RANDOM") != "1",
        suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for operation in operations:
            if time.monotonic() > deadline:
                break

            @fuzz_settings
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                if time.monotonic() > deadline:
                    return
                response = case.call(base_url=dev_server.url, headers=auth, timeout=15)
                label = operation.label  # noqa: B023 - run() is called below, within this iteration
                counts[label] = counts.get(label, 0) + 1
                _check_response(case, response, mode)  # noqa: B023 - as above
                negative = mode is GenerationMode.NEGATIVE and not _violation_not_sent(schema, case)  # noqa: B023 - as above
                mode_checks = checks + ([negative_data_rejection] if negative else [])
                case.validate_response(response, checks=mode_checks, headers=auth)

            run()

    # Bounded, but not vacuous: every operation really was exercised.
    assert set(counts) == {op.label for op in operations}, counts
    assert sum(counts.values()) >= len(operations) * 4, counts
    assert "Traceback" not in dev_server.output()
