"""PostgreSQL for tests: the shared server (``RDQ_TEST_PG_URL``), worked in through a scratch
database or schema of our own and never stopped; a throwaway cluster a fault test crashes and
restarts; and PgBouncer in transaction mode in front of a server."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import ContextManager, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..conditions import wait_until
from .processes import OwnedProcessServer, ServerStartError, free_loopback_port, pid_alive, port_refuses, running

SHARED_PG_URL = os.environ.get("RDQ_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_BIN = Path(os.environ.get("RDQ_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class OwnedPostgres:
    """A throwaway PostgreSQL cluster (initdb in a temp dir), run as the ``postgres`` user when
    we are root (PostgreSQL refuses to run as root); ``pg_ctl`` manages it by its data dir."""

    def __init__(self, prefix: str = "rdq-owned-pg-") -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.data = self.workdir / "data"
        self.log = self.workdir / "server.log"
        self.port = free_loopback_port()
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_postgres:
            shutil.chown(self.workdir, "postgres")
        self._run(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: object) -> None:
        subprocess.run(self.as_postgres + [str(a) for a in argv], check=True, capture_output=True, timeout=60)

    @property
    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> "OwnedPostgres":
        options = f"-p {self.port} -h 127.0.0.1 -k {self.workdir} -c fsync=off -c full_page_writes=off"
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "30", "-o", options, "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (sessions terminated); ``immediate``: a crash (recovery on start)."""
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "30", "stop")
        wait_until(lambda: port_refuses(self.port), timeout=10, what="the owned PostgreSQL to stop listening")

    def destroy(self) -> None:
        pid = self.postmaster_pid
        try:
            self.stop("immediate")
        except Exception:  # noqa: BLE001 - fall back to the PID the cluster wrote
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)


class OwnedPgBouncer(OwnedProcessServer):
    """Debian's ``pgbouncer`` in **transaction** mode in front of a PostgreSQL server: every
    database name is passed through (``* =``), at most ``server_connections`` server connections
    per database, trust auth for ``postgres``. Run as the ``postgres`` user when we are root
    (pgbouncer refuses root) through ``setpriv``, which execs it: the PID we started is
    pgbouncer's own. A server answering on our port is ours when its admin console reports our
    pid file (pgbouncer has no SQL that returns its PID)."""

    what = "pgbouncer"

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432, server_connections: int = 20,
                 max_clients: int = 400) -> None:
        super().__init__("rdq-owned-pgbouncer-", new_session=True)
        self.upstream = (upstream_host, upstream_port)
        self.server_connections = server_connections
        self.max_clients = max_clients
        self.as_postgres = (["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
                            if os.geteuid() == 0 else [])
        if self.as_postgres:
            shutil.chown(self.workdir, "postgres")
        (self.workdir / "users.txt").write_text('"postgres" ""\n')
        #: Extra ``[databases]`` entries by name (``schema_url``).
        self.aliases: dict[str, str] = {}

    def _write_config(self, port: int) -> Path:
        host, upstream_port = self.upstream
        config = self.workdir / "pgbouncer.ini"
        aliases = "".join(f"{line}\n" for line in self.aliases.values())
        config.write_text(f"""[databases]
{aliases}* = host={host} port={upstream_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {self.workdir / "users.txt"}
admin_users = postgres
pool_mode = transaction
default_pool_size = {self.server_connections}
max_db_connections = {self.server_connections}
max_client_conn = {self.max_clients}
server_idle_timeout = 5
server_lifetime = 60
ignore_startup_parameters = extra_float_digits
pidfile = {self.workdir / "pgbouncer.pid"}
logfile = {self.workdir / "pgbouncer.log"}
""")
        return config

    def argv(self, port: int) -> list[str]:
        config = self._write_config(port)
        return [*self.as_postgres, shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", str(config)]

    def served_pid(self, port: int) -> int | None:
        import psycopg

        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/pgbouncer", autocommit=True,
                                 connect_timeout=1, prepare_threshold=None) as admin:
                rows = admin.execute("SHOW CONFIG").fetchall()
        except psycopg.Error:
            return None
        settings = {row[0]: row[1] for row in rows}
        if settings.get("pidfile") != str(self.workdir / "pgbouncer.pid"):
            return -1  # a pgbouncer that is not ours
        try:  # ours: the PID it wrote (setpriv execs, so it is the PID we started)
            return int((self.workdir / "pgbouncer.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _log_tail(self) -> str:
        logs = [self.workdir / "server.log", self.workdir / "pgbouncer.log"]
        return "".join(log.read_text(errors="replace") for log in logs if log.exists())

    def url_for(self, direct_url: str) -> str:
        """``direct_url``'s database through this pgbouncer, with no startup session settings
        (pgbouncer refuses the ``options`` startup parameter)."""
        parts = urlsplit(direct_url)
        query = dict(parse_qsl(parts.query))
        query.pop("options", None)
        query["rdq_session_timeouts"] = "off"
        query["listen"] = "off"  # LISTEN needs a session, which transaction pooling does not give
        return urlunsplit(parts._replace(netloc=f"postgres@127.0.0.1:{self.port}", query=urlencode(query)))

    def schema_url(self, direct_url: str) -> str:
        """A new, empty schema in ``direct_url``'s database, reached through this pgbouncer under a
        database name of its own whose server connections select it (``connect_query``): how a
        pooler selects a schema, since ``search_path`` cannot travel in the startup options.
        Cheaper than a database per store; the schema goes with its database."""
        import psycopg
        from psycopg import sql

        schema = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(direct_url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        host, upstream_port = self.upstream
        database = urlsplit(direct_url).path.lstrip("/")
        self.aliases[schema] = (f"{schema} = host={host} port={upstream_port} dbname={database} "
                                f"connect_query='SET search_path TO {schema}'")
        self._write_config(self.port)
        self.admin("RELOAD")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{schema}?rdq_session_timeouts=off&listen=off"

    def admin(self, command: str) -> None:
        """One command on pgbouncer's admin console (``RELOAD``, ``DISABLE db``, ``KILL db``...)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer", autocommit=True,
                             connect_timeout=2, prepare_threshold=None) as console:
            console.execute(command)

    def server_connections_now(self) -> int:
        """Server connections pgbouncer holds to PostgreSQL now (``SHOW SERVERS``)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer", autocommit=True,
                             connect_timeout=2, prepare_threshold=None) as admin:
            return len(admin.execute("SHOW SERVERS").fetchall())


def pgbouncer(server_connections: int = 20, upstream_port: int = 5432) -> ContextManager[OwnedPgBouncer]:
    """A transaction-mode pgbouncer for the block, stopped by PID after it."""
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        raise ServerStartError("pgbouncer is not installed (apt-get install pgbouncer)")
    return running(OwnedPgBouncer(upstream_port=upstream_port, server_connections=server_connections))



def pg_url_with_database(url: str, database: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


def pg_url_with_search_path(url: str, schema: str) -> str:
    """Adds ``options=-csearch_path=<schema>`` (libpq's own way to set a session GUC)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    option = f"-csearch_path={schema}"
    query["options"] = f"{query['options']} {option}" if "options" in query else option
    return urlunsplit(parts._replace(query=urlencode(query)))


def pg_reachable(admin_url: str) -> str | None:
    """None when PostgreSQL answers at ``admin_url``, else why not."""
    import psycopg

    try:
        psycopg.connect(admin_url, autocommit=True, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        return f"PostgreSQL is not reachable at {admin_url} (set RDQ_TEST_PG_URL): {exc}"
    return None


@contextmanager
def pg_scratch_database(admin_url: str = SHARED_PG_URL, prefix: str = "rdq_test_") -> Iterator[str]:
    """A database of our own on ``admin_url``'s server, dropped afterwards (only that one)."""
    import psycopg
    from psycopg import sql

    name = f"{prefix}{secrets.token_hex(6)}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_url_with_database(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def pg_fresh_schema(database_url: str, prefix: str = "t_") -> str:
    """A new, empty schema in ``database_url``; returns a URL that selects it (``search_path``).
    It goes when its database is dropped."""
    import psycopg
    from psycopg import sql

    schema = f"{prefix}{secrets.token_hex(6)}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    return pg_url_with_search_path(database_url, schema)

