"""An operation's rate is bounded where it enters (the API, the client, the CLI), with a 422 that
names the field and the range; a second operation on a busy queue is a 409."""

from __future__ import annotations

from typing import Any

import pytest

from rdq_core import Client
from rdq_core.hosts import cli
from rdq_core.compliance.support import dead_letter
from rdq_core.errors import InvalidInput
from rdq_core.hosts.aws_lambda import connection

from .test_api import call, request

TOO_SMALL = (5e-324, 1e-12, 0.001, 0)


@pytest.mark.parametrize("rate", [*TOO_SMALL, 100_001, "1"])
def test_the_api_refuses_a_rate_outside_the_bounds_naming_field_and_range(store_url: str, lambda_context: Any,
                                                                          rate: Any) -> None:
    dead_letter(connection.shared_storage(), "rates", 2)
    status, _, problem = call(request("POST", "/v1/queues/rates/dlq:redrive", {"all": True, "rate_per_second": rate}),
                              lambda_context)
    assert status == 422, problem
    assert "rate_per_second" in problem["detail"] and "0.01..100000" in problem["detail"], problem
    assert Client(connection.shared_storage()).list_operations() == [], "nothing was started"


def test_the_api_answers_409_to_a_second_operation_on_a_busy_queue(store_url: str, lambda_context: Any) -> None:
    dead_letter(connection.shared_storage(), "busy", 2)
    first = request("POST", "/v1/queues/busy/dlq:redrive", {"all": True, "rate_per_second": 0.01})
    assert call(first, lambda_context)[0] == 202
    status, _, problem = call(request("POST", "/v1/queues/busy/dlq:purge", {"all": True, "background": True}),
                              lambda_context)
    assert status == 409, problem


@pytest.mark.parametrize("rate", TOO_SMALL)
def test_the_client_refuses_a_rate_outside_the_bounds(tmp_path: Any, rate: float) -> None:
    with Client(f"sqlite:///{tmp_path}/rdq.db") as client:
        client.storage.migrate()
        with pytest.raises(InvalidInput) as refused:
            client.start_operation("redrive", "q", all=True, rate_per_second=rate)
        assert refused.value.field == "rate_per_second" and "0.01..100000" in str(refused.value)


@pytest.mark.parametrize("rate", ["5e-324", "1e-12", "0", "nan", "inf", "fast"])
def test_the_cli_refuses_a_rate_outside_the_bounds(rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["dlq", "redrive", "q", "--all", "--rate", rate])
    assert exited.value.code == 2
    assert "--rate: must be a number of tasks a second in 0.01..100000" in capsys.readouterr().err
