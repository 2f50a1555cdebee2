"""Every AWS SDK client rdq builds comes from here, with short timeouts and a single attempt.

botocore's defaults (60 s connect, 60 s read, several attempts) turn an unreachable endpoint
into minutes: a function in a private subnet without a NAT gateway or an interface endpoint
would spend its whole invocation connecting. rdq's calls to AWS are small (a secret, an SSM
parameter, an asynchronous invoke, a schedule, an S3 object of at most a few hundred KB), so a
few seconds is ample; the caller decides what a failure means (an error answer, a best-effort
call given up), and nothing retries behind its back.

``RDQ_AWS_CONNECT_TIMEOUT`` and ``RDQ_AWS_READ_TIMEOUT`` (seconds) change the defaults for every
client of a process; a client may ask for a longer read timeout (S3 transfers).
"""

from __future__ import annotations

import os
from typing import Any

#: Seconds to open a connection to an AWS endpoint (botocore's default: 60).
DEFAULT_CONNECT_TIMEOUT = 2.0
#: Seconds to wait for an answer on an open connection (botocore's default: 60).
DEFAULT_READ_TIMEOUT = 5.0


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    try:
        return float(text) if text else default
    except ValueError:
        return default


def client_config(*, connect_timeout: float | None = None, read_timeout: float | None = None, **extra: Any) -> Any:
    """The botocore ``Config`` of every rdq client: bounded connect and read, one attempt in all
    (``total_max_attempts`` counts the first; botocore's ``max_attempts`` would count retries)."""
    from botocore.config import Config

    return Config(
        connect_timeout=connect_timeout if connect_timeout is not None
        else _seconds("RDQ_AWS_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT),
        read_timeout=read_timeout if read_timeout is not None
        else _seconds("RDQ_AWS_READ_TIMEOUT", DEFAULT_READ_TIMEOUT),
        retries={"total_max_attempts": 1, "mode": "standard"},
        **extra,
    )


def aws_client(service: str, *, connect_timeout: float | None = None, read_timeout: float | None = None,
               **config: Any) -> Any:
    """A boto3 client for ``service`` with rdq's bounds (``client_config``); ``config`` adds
    other ``Config`` settings (``signature_version`` for S3)."""
    import boto3  # in the Lambda runtime; imported only when a client is needed

    make: Any = boto3.client  # typed per service name by boto3-stubs; this factory serves any
    return make(service, config=client_config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                                                      **config))
