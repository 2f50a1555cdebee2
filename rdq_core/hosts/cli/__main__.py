"""``python -m rdq_core.hosts.cli``: the ``rdq`` command."""

import sys

from .main import main

sys.exit(main())
