"""Dedupe with payloads kept in the payload store (the local-directory store): a skipped request's
upload is deleted, a replacing request's upload becomes the matched task's payload and is kept."""

from __future__ import annotations

from rdq_core.engine import payloads

from .test_payloads import _files, client, store  # noqa: F401 - fixtures

BIG = 300_000  # over the inline threshold: goes to the payload store


def test_a_skipped_request_deletes_its_upload(client, store):  # noqa: F811 - fixtures
    first = client.enqueue("q", "h", {"t": "x" * BIG}, dedupe_key="k")
    again = client.enqueue("q", "h", {"t": "y" * BIG}, dedupe_key="k")
    assert again.id == first.id and len(_files(store)) == 1
    assert payloads.task_payload(client.get(first.id)) == {"t": "x" * BIG}


def test_a_replacing_request_keeps_its_upload_as_the_matched_task_payload(client, store):  # noqa: F811
    first = client.enqueue("q", "h", {"t": "x" * BIG}, dedupe_key="k")
    replaced = client.enqueue("q", "h", {"t": "y" * BIG}, dedupe_key="k", dedupe_mode="replace")
    assert replaced.id == first.id and len(_files(store)) == 2, "the old object is left to the bucket's lifecycle"
    assert payloads.task_payload(client.get(first.id)) == {"t": "y" * BIG}
    inline = client.enqueue("q", "h", {"small": 1}, dedupe_key="k", dedupe_mode="replace")
    task = client.get(inline.id)
    assert payloads.payload_ref(task) is None and payloads.task_payload(task) == {"small": 1}
