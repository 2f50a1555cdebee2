"""How ``HttpClient`` (and ``rdq console``) prove who is calling: SigV4, an API key, a bearer
token or nothing, and which of them a URL gets when none is named."""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from ..errors import ConfigurationError, NotAuthorized


class Auth(Protocol):
    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """The headers to add to a request about to be sent (called again for every retry)."""


@dataclass(frozen=True)
class BearerToken:
    """``Authorization: Bearer <token>``: ``rdq dev`` with ``RDQ_API_TOKEN``."""

    token: str

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def __repr__(self) -> str:
        return "BearerToken(***)"


@dataclass(frozen=True)
class ApiKey:
    """``x-api-key: <key>``: a stack deployed with the API-key auth mode."""

    key: str

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {"x-api-key": self.key}

    def __repr__(self) -> str:
        return "ApiKey(***)"


@dataclass(frozen=True)
class NoAuth:
    """No credentials at all: ``rdq dev`` without ``RDQ_API_TOKEN`` (the default for a loopback
    API), or an API behind a gateway of your own that authenticates by other means."""

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {}


def default_auth(api_url: str, *, profile: str | None = None, region: str | None = None) -> Auth:
    """The credentials ``HttpClient`` and ``rdq --api`` send when none are named: none to an API
    on a loopback address (``rdq dev``, which without a token serves loopback callers only and
    never checks AWS credentials), SigV4 to any other (a deployed stack's IAM auth)."""
    host = urllib.parse.urlsplit(api_url).hostname or ""
    if is_loopback(host):
        return NoAuth()
    return SigV4(profile=profile, region=region)


class SigV4:
    """AWS Signature Version 4 for API Gateway (service ``execute-api``) with botocore's signer.

    Credentials come from the standard chain of ``botocore.session.Session(profile=profile)``
    and are asked for at each request, so expiring ones (SSO, roles) are refreshed by botocore.
    The region is ``region`` if given, else the session's (``AWS_DEFAULT_REGION``, the profile),
    else the one in an ``….execute-api.<region>.amazonaws.com`` host name.
    """

    def __init__(self, *, profile: str | None = None, region: str | None = None, service: str = "execute-api",
                 session: Any = None) -> None:
        try:
            import botocore.session
        except ImportError:
            raise ConfigurationError(
                "SigV4 signing needs botocore: pip install botocore (or rdq's dev extra), or use an API key,"
                " a bearer token or NoAuth()") from None
        self._session = session if session is not None else botocore.session.Session(profile=profile)
        self._region = region or self._session.get_config_variable("region")
        self.service = service

    def region_for(self, url: str) -> str:
        if self._region:
            return str(self._region)
        host = urllib.parse.urlsplit(url).hostname or ""
        parts = host.split(".")
        if len(parts) >= 4 and parts[1] == "execute-api":
            return parts[2]
        raise ConfigurationError("no AWS region: pass region=, set AWS_REGION/AWS_DEFAULT_REGION, or set one in the profile")

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        credentials = self._session.get_credentials()
        if credentials is None:
            raise NotAuthorized("no AWS credentials found (environment, profile, SSO or instance role)")
        request = AWSRequest(method=method, url=url, data=body, headers=dict(headers))
        SigV4Auth(credentials.get_frozen_credentials(), self.service, self.region_for(url)).add_auth(request)
        signed = {"Authorization", "X-Amz-Date", "X-Amz-Security-Token"}
        return {name: str(value) for name, value in request.headers.items() if name in signed}

    def __repr__(self) -> str:
        return f"SigV4(region={self._region!r}, service={self.service!r})"


def plaintext_credential_warning(api_url: str, auth: Auth | None) -> str | None:
    """A warning for sending an API key or bearer token over plain HTTP to another machine
    (anyone on the path reads and replays it), else None. Loopback (``rdq dev``) is exempt."""
    if not isinstance(auth, (ApiKey, BearerToken)):
        return None
    parts = urllib.parse.urlsplit(api_url)
    if parts.scheme != "http" or not parts.hostname or is_loopback(parts.hostname):
        return None
    what = "API key" if isinstance(auth, ApiKey) else "bearer token"
    return (f"warning: the {what} travels unencrypted to http://{parts.netloc}: anyone on the network path can "
            "read and reuse it; use https://")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
