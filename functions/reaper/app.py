"""Lambda entry point of the reaper function (all logic: rdq_core.hosts.aws_lambda.reaper)."""

from rdq_core.hosts.aws_lambda.reaper import lambda_handler

__all__ = ["lambda_handler"]
