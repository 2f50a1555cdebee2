"""The Redis backend (``redis://``, ``rediss://``).

| file | what it holds |
| --- | --- |
| ``backend.py`` | ``RedisStorage``: the storage core's primitives, each one or two script calls |
| ``connection.py`` | the client an instance holds, and sending scripts by SHA (NOSCRIPT, pipelines, WAIT) |
| ``encoding.py`` | script arguments and replies: microseconds, repaired JSON, codec records |
| ``client.py`` | the URL: key prefix, Cluster or not, timeouts, no resends |
| ``lua.py`` | the scripts as the server runs them (includes + file), sent by SHA |
| ``scripts/*.lua`` | one Lua script per operation, plus the two files included before them |
"""

from .backend import RedisStorage

# The argument encoders, for tests that send malformed items straight to a script.
from .encoding import _enqueue_args as _enqueue_args
from .encoding import _settle_args as _settle_args

__all__ = ["RedisStorage"]
