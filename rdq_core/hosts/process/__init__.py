"""``rdq worker``: the long-running worker (``worker``) and the process that supervises it
(``supervisor``: signals, restarts after a handler overran)."""
