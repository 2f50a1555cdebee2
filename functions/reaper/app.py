"""Lambda entry point of the reaper function (all logic: rdq_core.lambda_host.reaper)."""

from rdq_core.lambda_host.reaper import lambda_handler

__all__ = ["lambda_handler"]
