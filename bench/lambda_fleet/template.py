"""The worker function as ``template.yaml`` declares it, with the scenario's parameters.

Only the intrinsics the template uses on the worker's properties the emulator reads are evaluated
(``Ref`` to a parameter or a pseudo parameter, ``Fn::If`` / ``Fn::Equals`` / ``Fn::Not`` /
``Fn::And`` / ``Fn::Or`` / ``Condition``, ``Fn::Sub`` with ``${Name}``, ``Fn::Join``). A ``Ref`` to a resource becomes a
made-up physical name: the worker only passes such names on (the payload bucket), and the bench's
payloads stay under the threshold that would use them. The file is read at each run, so the
emulator follows the template as it changes (new parameters, new variables).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..common import ROOT

TEMPLATE = ROOT / "template.yaml"
WORKER_RESOURCE = "WorkerFunction"
ACCOUNT = "123456789012"
REGION = "us-east-1"
#: Lambda's own defaults for what a template may leave out.
DEFAULT_MEMORY_MB = 128
DEFAULT_TIMEOUT_S = 3
DEFAULT_EVENT_AGE_S = 21600
DEFAULT_RETRY_ATTEMPTS = 2

_NO_VALUE = object()


@dataclass(frozen=True)
class FunctionConfig:
    """What the emulator needs of one function."""

    name: str
    code_dir: Path
    handler: str
    timeout_s: float
    memory_mb: int
    environment: dict[str, str]
    reserved_concurrency: int | None
    max_event_age_s: float
    max_retry_attempts: int
    architecture: str
    parameters: dict[str, str] = field(default_factory=dict)

    @property
    def arn(self) -> str:
        return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{self.name}"


class _Resolver:
    def __init__(self, template: Mapping[str, Any], parameters: Mapping[str, str], stack: str) -> None:
        self.template = template
        declared = template.get("Parameters") or {}
        self.parameters: dict[str, str] = {name: str(spec.get("Default", "")) for name, spec in declared.items()}
        unknown = sorted(set(parameters) - set(declared))
        if unknown:
            raise ValueError(f"template.yaml declares no parameter {', '.join(unknown)}")
        self.parameters.update({k: str(v) for k, v in parameters.items()})
        self.pseudo = {"AWS::StackName": stack, "AWS::Region": REGION, "AWS::AccountId": ACCOUNT,
                       "AWS::Partition": "aws", "AWS::URLSuffix": "amazonaws.com"}
        self.stack = stack

    def condition(self, name: str) -> bool:
        return bool(self.value((self.template.get("Conditions") or {})[name]))

    def ref(self, name: str) -> Any:
        if name == "AWS::NoValue":
            return _NO_VALUE
        if name in self.pseudo:
            return self.pseudo[name]
        if name in self.parameters:
            return self.parameters[name]
        if name in (self.template.get("Resources") or {}):
            return f"{self.stack}-{name}".lower()
        raise ValueError(f"unresolvable Ref {name}")

    def value(self, node: Any) -> Any:
        if isinstance(node, list):
            return [v for v in (self.value(item) for item in node) if v is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (key, arg), = node.items()
            if key == "Ref":
                return self.ref(arg)
            if key == "Condition":
                return self.condition(arg)
            if key == "Fn::If":
                name, then, otherwise = arg
                return self.value(then if self.condition(name) else otherwise)
            if key == "Fn::Equals":
                left, right = (self.value(v) for v in arg)
                return str(left) == str(right)
            if key == "Fn::Not":
                return not self.value(arg[0])
            if key == "Fn::And":
                return all(self.value(v) for v in arg)
            if key == "Fn::Or":
                return any(self.value(v) for v in arg)
            if key == "Fn::Sub":
                return self.sub(arg)
            if key == "Fn::Join":
                return str(arg[0]).join(str(v) for v in self.value(arg[1]))
            if key.startswith("Fn::"):
                raise ValueError(f"{key} is not evaluated by the emulator's template reader")
        return {k: v for k, v in ((k, self.value(v)) for k, v in node.items()) if v is not _NO_VALUE}

    def sub(self, arg: Any) -> str:
        text, names = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])
        return re.sub(r"\$\{([^}!]+)\}",
                      lambda m: str(self.value(names[m.group(1)]) if m.group(1) in names else self.ref(m.group(1))),
                      text)


def worker_function(parameters: Mapping[str, str], *, stack: str = "rdq-fleet",
                    template_path: Path = TEMPLATE) -> FunctionConfig:
    """The worker function's configuration: Globals.Function merged under its own properties,
    its environment with ``parameters`` (template parameter name → value) substituted."""
    from samtranslator.yaml_helper import yaml_parse  # type: ignore[import-untyped]  # CloudFormation's short tags

    template = yaml_parse(template_path.read_text())
    resolver = _Resolver(template, parameters, stack)
    # Only the properties read below are evaluated: the rest (VPC, policies, layers) may use
    # intrinsics this reader does not know, and means nothing here.
    wanted = ("FunctionName", "CodeUri", "Handler", "Timeout", "MemorySize", "Architectures", "Environment",
              "ReservedConcurrentExecutions", "EventInvokeConfig")
    raw_globals = (template.get("Globals") or {}).get("Function") or {}
    raw_props = template["Resources"][WORKER_RESOURCE]["Properties"]
    globals_ = resolver.value({k: v for k, v in raw_globals.items() if k in wanted})
    props = resolver.value({k: v for k, v in raw_props.items() if k in wanted})
    variables: dict[str, Any] = {**((globals_.get("Environment") or {}).get("Variables") or {}),
                                 **((props.get("Environment") or {}).get("Variables") or {})}
    invoke_config = props.get("EventInvokeConfig") or {}
    reserved = props.get("ReservedConcurrentExecutions")
    architectures = props.get("Architectures") or globals_.get("Architectures") or ["x86_64"]
    return FunctionConfig(
        name=str(props.get("FunctionName") or f"{stack}-{WORKER_RESOURCE}"),
        code_dir=ROOT / str(props.get("CodeUri") or globals_.get("CodeUri")),
        handler=str(props.get("Handler") or globals_.get("Handler")),
        timeout_s=float(props.get("Timeout") or globals_.get("Timeout") or DEFAULT_TIMEOUT_S),
        memory_mb=int(props.get("MemorySize") or globals_.get("MemorySize") or DEFAULT_MEMORY_MB),
        environment={k: _env_text(v) for k, v in variables.items()},
        reserved_concurrency=int(reserved) if reserved is not None else None,
        max_event_age_s=float(invoke_config.get("MaximumEventAgeInSeconds", DEFAULT_EVENT_AGE_S)),
        max_retry_attempts=int(invoke_config.get("MaximumRetryAttempts", DEFAULT_RETRY_ATTEMPTS)),
        architecture=str(architectures[0]),
        parameters=dict(resolver.parameters),
    )


def declared_parameters(template_path: Path = TEMPLATE) -> set[str]:
    from samtranslator.yaml_helper import yaml_parse

    return set((yaml_parse(template_path.read_text()).get("Parameters") or {}))


def _env_text(value: Any) -> str:
    # CloudFormation turns every environment value into a string; booleans the way YAML wrote them.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
