"""Suite-wide settings. Powertools reads its environment at import time, and any test package
may be the first to import the Lambda host, so the offline AWS settings live here, once."""

import os

for _name, _value in {
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "SAM_CLI_TELEMETRY": "0",
    "POWERTOOLS_TRACE_DISABLED": "1",
    "POWERTOOLS_METRICS_NAMESPACE": "rdq",
    "POWERTOOLS_SERVICE_NAME": "rdq",
    "POWERTOOLS_LOG_LEVEL": "WARNING",
}.items():
    os.environ[_name] = _value
