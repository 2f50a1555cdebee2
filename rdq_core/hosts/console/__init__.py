"""The operator web console: static files (``static/``) served by ``rdq dev`` at ``/`` and by
``rdq console`` (``server.py``), which also forwards the console's API calls to a deployed API
with the operator's own credentials. The console calls the API at relative URLs (``v1/...``), so
it works under any path prefix."""
