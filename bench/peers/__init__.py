"""Drivers for the peer queues, written against their public APIs (no code copied from them).

Each peer runs no-op jobs with its own recommended (default) settings and its bulk enqueue API,
on the same PostgreSQL / Redis servers as rdq. Jobs time themselves with ``bench.common.JobCounter``.
"""
