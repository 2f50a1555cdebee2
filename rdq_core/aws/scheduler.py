"""EventBridge Scheduler: where the deployed stack keeps rdq's schedules, one Scheduler schedule
per rdq schedule in one group (``RDQ_SCHEDULE_GROUP``).

A schedule's whole definition travels in its target's ``Input`` (``target_input``), next to the
scheduled-time placeholder Scheduler substitutes with each period's instant; the worker function
reads both back from the invocation's event (``fired_definition``). What a definition holds, how
it is validated and how a period fires are the engine's (``rdq_core/engine/schedules.py``,
``SchedulerBook``); this module speaks to the service and turns its failures into rdq's errors.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping

from ..errors import InvalidInput, ScheduleNotFound, StorageUnavailable

#: The key of a Scheduler target's input that marks an rdq firing for the worker function.
EVENT_KEY = "rdq_schedule"
#: The context attribute Scheduler replaces with the period's instant (``2022-03-22T18:59:43Z``).
SCHEDULED_TIME = "<aws.scheduler.scheduled-time>"


def target_input(definition: Mapping[str, Any]) -> str:
    """The Scheduler target's ``Input``: the definition (``Schedule.to_dict()``, less the local
    ``created_at``) and the scheduled-time context attribute."""
    kept = {k: v for k, v in definition.items() if k != "created_at"}
    return json.dumps({EVENT_KEY: kept, "scheduled_time": SCHEDULED_TIME}, separators=(",", ":"))


def fired_definition(event: Any) -> tuple[Any, Any] | None:
    """The definition and the scheduled time (as Scheduler substituted it, unchecked) of a
    Scheduler-triggered invocation; None for any other event."""
    if not isinstance(event, Mapping) or EVENT_KEY not in event:
        return None
    return event[EVENT_KEY], event.get("scheduled_time")


class _Exists(Exception):
    """``create_schedule`` met a schedule of that name (``ConflictException``): replace it."""


class EventBridgeScheduler:
    """The schedules of one Scheduler group, all targeting one function through one role.

    Calls use rdq's short timeouts (``rdq_core.aws.clients``) so that an API request never waits
    long on Scheduler. Failures: a missing schedule is ``ScheduleNotFound``, a refused request
    ``InvalidInput`` (422), anything that may pass (throttling, a timeout, an unreachable
    endpoint) ``StorageUnavailable`` (503)."""

    def __init__(self, group: str, role_arn: str, target_arn: str, client: Any = None) -> None:
        self.group = group
        self.role_arn = role_arn
        self.target_arn = target_arn
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            from .clients import aws_client

            self._client = aws_client("scheduler")
        return self._client

    def _call(self, operation: str, *, refused_field: str = "name", **request: Any) -> Any:
        """One Scheduler call. A request Scheduler refuses itself is ``InvalidInput`` on
        ``refused_field``, whichever call it was, so no refusal reaches a client as a 500."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(**request)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            message = exc.response.get("Error", {}).get("Message", "")
            if code == "ResourceNotFoundException":
                raise ScheduleNotFound(str(request.get("Name", ""))) from None
            if code == "ConflictException" and operation == "create_schedule":
                raise _Exists() from None
            if code in ("ValidationException", "ConflictException"):
                raise InvalidInput(f"EventBridge Scheduler refused the request: {message or code}",
                                   refused_field) from None
            raise StorageUnavailable(f"EventBridge Scheduler {operation}: {code} {message}".strip()) from None
        except BotoCoreError as exc:
            raise StorageUnavailable(f"EventBridge Scheduler {operation}: {exc}") from None

    def put(self, definition: Mapping[str, Any], *, description: str, start_date: datetime | None = None) -> None:
        """Create the schedule ``definition`` names, or replace it: its ``expression`` in its
        ``timezone``, firing the target with ``target_input(definition)``; a ``start_date``
        (a rate's first aligned instant) when given."""
        request: dict[str, Any] = {
            "Name": definition["name"], "GroupName": self.group, "ScheduleExpression": definition["expression"],
            "ScheduleExpressionTimezone": definition["timezone"], "FlexibleTimeWindow": {"Mode": "OFF"},
            "State": "ENABLED", "Description": description,
            "Target": {"Arn": self.target_arn, "RoleArn": self.role_arn, "Input": target_input(definition),
                       "RetryPolicy": {"MaximumEventAgeInSeconds": 3600, "MaximumRetryAttempts": 10}},
        }
        if start_date is not None:
            request["StartDate"] = start_date
        try:
            self._call("create_schedule", refused_field="expression", **request)
        except _Exists:
            self._call("update_schedule", refused_field="expression", **request)  # create or replace

    def definition(self, name: str) -> Any:
        """The definition schedule ``name`` carries in its target's input; ``InvalidInput`` when
        the schedule is not an rdq one."""
        answer = self._call("get_schedule", Name=name, GroupName=self.group)
        try:
            body = json.loads(answer.get("Target", {}).get("Input") or "{}")
        except ValueError:
            raise InvalidInput(f"schedule {answer.get('Name')!r} is not an rdq schedule", "name") from None
        if not isinstance(body, Mapping) or EVENT_KEY not in body:
            raise InvalidInput(f"schedule {answer.get('Name')!r} is not an rdq schedule", "name")
        return body[EVENT_KEY]

    def names(self) -> list[str]:
        """The names of every schedule in the group, rdq's or not."""
        names: list[str] = []
        token: str | None = None
        while True:
            page = self._call("list_schedules", GroupName=self.group, MaxResults=100,
                              **({"NextToken": token} if token else {}))
            names.extend(item["Name"] for item in page.get("Schedules", []))
            token = page.get("NextToken")
            if not token:
                return names

    def delete(self, name: str) -> None:
        self._call("delete_schedule", Name=name, GroupName=self.group)
