"""Lambda entry point of the worker function (all logic: rdq_core.lambda_host.worker)."""

from rdq_core.lambda_host.worker import lambda_handler

__all__ = ["lambda_handler"]
