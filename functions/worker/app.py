"""Lambda entry point of the worker function (all logic: rdq_core.hosts.aws_lambda.worker)."""

from rdq_core.engine.handlers import registry
from rdq_core.hosts.aws_lambda.settings import Settings
from rdq_core.hosts.aws_lambda.worker import lambda_handler

# Handler names the operator bound to a Lambda function or an HTTPS endpoint (RDQ_TARGETS, the
# Targets parameter), registered once per container; a malformed binding fails the cold start.
_targets = Settings.from_env().targets()
if _targets:
    from rdq_core.targets import bind_targets

    bind_targets(_targets, into=registry)

__all__ = ["lambda_handler"]
