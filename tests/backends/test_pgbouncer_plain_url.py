"""A plain PostgreSQL URL pointed at PgBouncer in transaction mode, as a newcomer first writes it:
PgBouncer refuses the startup ``options`` rdq's session timeouts travel in, and rdq says so, with
the URL parameters that fix it, instead of passing on PgBouncer's bare ``FATAL``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from rdq_core import Client  # noqa: E402 - after importorskip
from rdq_testing.servers import SHARED_PG_URL, OwnedPgBouncer, pg_scratch_database  # noqa: E402 - see above
from rdq_core.errors import ConfigurationError  # noqa: E402 - after importorskip

RDQ = shutil.which("rdq") or pytest.fail("the rdq executable is not installed (python -m pip install -e .)")
FIX = "rdq_session_timeouts=off&listen=off"


@pytest.fixture(scope="module")
def plain_bounced_url(bouncer: OwnedPgBouncer) -> Iterator[str]:
    """A scratch database through the pooler, with nothing rdq-specific in its URL."""
    with pg_scratch_database(SHARED_PG_URL, prefix="rdq_plain_") as direct:
        yield f"postgresql://postgres@127.0.0.1:{bouncer.port}/{direct.rsplit('/', 1)[1].split('?')[0]}"


def rdq(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    return subprocess.run([RDQ, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_rdq_migrate_through_pgbouncer_with_a_plain_url_names_the_fix_and_the_fix_works(
        plain_bounced_url: str, tmp_path: Path) -> None:
    refused = rdq(tmp_path, "--storage", plain_bounced_url, "migrate")
    assert refused.returncode == 2, refused.stderr
    assert "PgBouncer" in refused.stderr and f"?{FIX}" in refused.stderr, refused.stderr
    assert "unexpected" not in refused.stderr and "Traceback" not in refused.stderr
    fixed = rdq(tmp_path, "--storage", f"{plain_bounced_url}?{FIX}", "migrate")
    assert fixed.returncode == 0, fixed.stderr
    assert rdq(tmp_path, "--storage", f"{plain_bounced_url}?{FIX}", "enqueue", "q", "greet").returncode == 0


def test_the_client_raises_a_configuration_error_and_a_url_with_a_query_gets_an_ampersand(plain_bounced_url: str) -> None:
    client = Client(f"{plain_bounced_url}?connect_timeout=5")
    try:
        with pytest.raises(ConfigurationError) as refused:
            client.stats("q")
    finally:
        client.close()
    assert f"&{FIX}" in str(refused.value) and "options" in str(refused.value)
