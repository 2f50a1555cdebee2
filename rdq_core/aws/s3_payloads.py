"""S3 as the store of large payloads and results (``RDQ_PAYLOAD_BUCKET``, the stack's bucket).

The format of a reference, the thresholds and the integrity check are the engine's
(``rdq_core/engine/payloads.py``); this module is the bucket behind its ``PayloadStore``
protocol: objects written, read, tagged and deleted, and presigned URLs for callers that upload
or download an object themselves. SSE-KMS and the lifecycle rules are the bucket's own settings
(template.yaml, ``PayloadBucket``).
"""

from __future__ import annotations

import base64
import threading
from typing import Any, Sequence

from ..errors import ConfigurationError, StorageUnavailable

#: S3's limit for one PUT (and so for a presigned upload): 5 GiB.
S3_SINGLE_PUT_BYTES = 5 * 1024**3
#: The tag the worker puts on a succeeded task's payload object; the bucket's lifecycle rule
#: expires tagged objects (and every ``results/`` object) after the retention period.
FINISHED_TAG = ("rdq-finished", "true")
#: The tag a presigned upload carries until a task is enqueued with it (``clear_pending``, called
#: by ``rdq_core.engine.payload_uploads.enqueued``, removes it): the bucket's lifecycle rule
#: expires tagged objects after ``PENDING_UPLOAD_DAYS``, so an upload no task ever names does not
#: stay in the bucket.
PENDING_TAG = ("rdq-pending", "true")
#: Days the lifecycle rule keeps a pending upload (template.yaml, PayloadBucket: never-enqueued-uploads).
PENDING_UPLOAD_DAYS = 2
#: Presigned URLs are valid this long.
PRESIGN_SECONDS = 900


class S3PayloadStore:
    """A bucket the stack owns (SSE-KMS and the lifecycle rule are the bucket's own settings)."""

    def __init__(self, bucket: str, client: Any = None) -> None:
        if not bucket:
            raise ConfigurationError("RDQ_PAYLOAD_BUCKET is empty")
        self.bucket = bucket
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from .clients import aws_client  # boto3 only where a bucket is configured

                # Objects are at most a few MB: a longer read than rdq's other calls, still one attempt.
                self._client = aws_client("s3", read_timeout=20.0, signature_version="s3v4")
            return self._client

    def _call(self, operation: str, **params: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **params)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code in ("AccessDenied", "403", "NoSuchBucket", "InvalidAccessKeyId", "KMS.DisabledException"):
                raise ConfigurationError(f"payload bucket {self.bucket!r}: {operation} refused ({code})") from None
            raise StorageUnavailable(f"payload bucket {self.bucket!r}: {operation} failed ({code})") from None
        except BotoCoreError as exc:
            raise StorageUnavailable(f"payload bucket {self.bucket!r}: {operation} failed ({exc})") from None

    def write(self, key: str, data: bytes) -> None:
        self._call("put_object", Key=key, Body=data, ContentType="application/json")

    def read(self, key: str) -> bytes | None:
        answer = self._call("get_object", Key=key)
        return None if answer is None else bytes(answer["Body"].read())

    def size_of(self, key: str) -> int | None:
        answer = self._call("head_object", Key=key)
        return None if answer is None else int(answer["ContentLength"])

    def delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            chunk = keys[start:start + 1000]
            answer = self._call("delete_objects", Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
            errors = (answer or {}).get("Errors") or []
            if errors:
                raise StorageUnavailable(f"payload bucket {self.bucket!r}: {len(errors)} object(s) not deleted "
                                         f"(first: {errors[0].get('Code')})")

    def mark_finished(self, key: str) -> None:
        self._call("put_object_tagging", Key=key,
                   Tagging={"TagSet": [{"Key": FINISHED_TAG[0], "Value": FINISHED_TAG[1]}]})

    def clear_pending(self, key: str) -> None:
        # The only tag an object has when its task is enqueued is the pending one (the worker
        # tags it finished later), so all of them go.
        self._call("delete_object_tagging", Key=key)

    def upload_target(self, key: str, size: int, sha256: str) -> dict[str, Any]:
        # Length, checksum and the pending tag are signed headers of the URL: S3 refuses a PUT of
        # another length or without the tag (SignatureDoesNotMatch), and one whose body does not
        # hash to the checksum (BadDigest). So the URL uploads this object and nothing larger.
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()
        tagging = f"{PENDING_TAG[0]}={PENDING_TAG[1]}"
        url = self.client.generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket, "Key": key, "ContentType": "application/json",
                                  "ContentLength": size, "ChecksumSHA256": checksum, "Tagging": tagging},
            ExpiresIn=PRESIGN_SECONDS)
        headers = {"Content-Type": "application/json", "Content-Length": str(size),
                   "x-amz-checksum-sha256": checksum, "x-amz-tagging": tagging}
        return {"url": url, "method": "PUT", "headers": headers}

    def download_url(self, key: str) -> str:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS)
        return url
