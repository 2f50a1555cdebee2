"""``HttpClient``: the ``Client`` interface over a deployed rdq API (or ``rdq dev``), over HTTPS.

```python
from rdq_core.http_client import ApiKey, BearerToken, HttpClient, SigV4

# A deployed stack (IAM auth): SigV4 is the default for any API that is not on a loopback
# address, with the standard AWS credential chain as the AWS CLI resolves it (environment,
# profile, SSO, instance/container role); region from the profile, else from the execute-api host.
rdq = HttpClient("https://abc123.execute-api.eu-west-1.amazonaws.com/prod")
rdq = HttpClient("https://abc123.execute-api.eu-west-1.amazonaws.com/prod", auth=SigV4(profile="ops"))
rdq = HttpClient(url, auth=ApiKey("…"))                        # AuthMode=apikey stacks (x-api-key)
rdq = HttpClient("http://127.0.0.1:8787")                       # rdq dev: loopback, no credentials by default
rdq = HttpClient("http://127.0.0.1:8787", auth=BearerToken(os.environ["RDQ_API_TOKEN"]))  # rdq dev with a token

task = rdq.enqueue("emails", "send_email", {"to": "a@b.c"}, id="order-42")
rdq.get(task.id).attempts
rdq.stats("emails").pending
page = rdq.list_dead("emails", error_type="TimeoutError")
rdq.redrive("emails", ids=[t.id for t in page.tasks])
```

Methods, signatures, return types and exceptions are ``Client``'s. The API validates (the same
code as ``Client``), so its refusals come back as the same exceptions: ``InvalidInput`` (with
``field``; ``InvalidCursor`` for a bad cursor), ``TaskNotFound``, ``TaskConflict``. Besides:
``NotAuthorized`` (401/403), and ``ApiUnavailable`` -- a ``StorageUnavailable`` -- when the API
cannot be reached or keeps answering 429/5xx until the retry budget (``retry_seconds``) is spent.
Its message names the API's host, never credentials.

Retries (capped, jittered exponential backoff, bounded in total time): reads and enqueues are
retried on connection errors, 429 and 5xx. That is safe for enqueue because every task carries an
id: one is generated here, before the first attempt, when the caller gave none, so a repeat after
a lost response finds the task already written (``created`` False) instead of writing another.

Differences from ``Client``: ``connection=`` (joining a database transaction) cannot cross HTTP
and raises ``UnsupportedOperation``; ``enqueue_many``'s per-item results carry what the batch
route answers (id, queue, status) with the request's own fields (handler, payload, headers,
max_attempts, backoff), no timestamps; a conflicting item's task has only its id, the requested
queue and status PENDING, because the API does not reveal the other queue's task.

Transport is the standard library (``http.client``): HTTPS with certificate verification, a
connect timeout and a read timeout. botocore is needed only for ``SigV4`` and imported then.

The rooms: ``auth`` (SigV4, API key, bearer token, none; ``default_auth``), ``transport`` (the
API's address, one request, retries, problems as exceptions), ``objects`` (presigned transfers
of large payloads) and ``client`` (``HttpClient``: ``Client``'s methods).
"""

from .auth import ApiKey, Auth, BearerToken, NoAuth, SigV4, default_auth, plaintext_credential_warning
from .client import HttpClient

__all__ = ["ApiKey", "Auth", "BearerToken", "HttpClient", "NoAuth", "SigV4", "default_auth", "plaintext_credential_warning"]
