"""``python -m rdq_core.cli``: the ``rdq`` command."""

import sys

from .main import main

sys.exit(main())
