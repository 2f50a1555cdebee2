"""The storage compliance kit: the executable specification of a backend.

A backend -- ours or a third party's -- passes the kit with a few lines of pytest::

    from typing import Iterator

    import pytest
    from rdq_core.compliance import StorageCompliance

    class TestMyBackend(StorageCompliance):
        @pytest.fixture
        def storage_url(self) -> Iterator[str]:
            url = make_fresh_isolated_store()      # empty, not yet migrated
            yield url
            drop_it(url)

``open_storage(url)`` must reach the backend: third-party schemes call
``rdq_core.storage.register_backend`` in a module listed in ``plugin_modules`` (the chaos test's
worker subprocesses import them too). Class attributes tune timing for slow stores, and
``capabilities = Capabilities(...)`` declares where a backend legitimately differs (round-trip
budgets, joining a caller's transaction, a URL for an unreachable server). The servers the tests
start and the processes the chaos tests kill are test support outside the runtime package
(``rdq_testing``); the kit drives them.
"""

import pkgutil

import pytest

# The kit's checks are plain asserts in an installed package, which pytest rewrites only when
# told to: without this a failing check says "AssertionError" and nothing of what it compared.
# The package itself is already importing, so its submodules are named one by one.
pytest.register_assert_rewrite(*(f"{__name__}.{module.name}" for module in pkgutil.iter_modules(__path__)))

from .capabilities import Capabilities, PerTask  # noqa: E402 - after the rewrite is registered
from .suite import StorageCompliance  # noqa: E402

__all__ = ["Capabilities", "PerTask", "StorageCompliance"]
