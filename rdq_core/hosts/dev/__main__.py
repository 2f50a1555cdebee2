"""``python -m rdq_core.hosts.dev``: ``rdq dev`` without the ``rdq`` CLI."""

from .command import main

main()
