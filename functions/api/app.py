"""Lambda entry point of the API function (all logic: rdq_core.lambda_host.api)."""

from rdq_core.lambda_host.api import lambda_handler

__all__ = ["lambda_handler"]
