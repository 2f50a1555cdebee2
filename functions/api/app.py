"""Lambda entry point of the API function (all logic: rdq_core.hosts.aws_lambda.api)."""

from rdq_core.hosts.aws_lambda.api import lambda_handler

__all__ = ["lambda_handler"]
