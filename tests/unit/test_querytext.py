"""Query text kept as data: named blocks, fragments, migrations."""

import pytest

from rdq_core.storage.querytext import parse_named

FILE = """-- preamble: documents the file, is not a query
-- name: cols
-- the columns every statement returns
t.id, t.queue

-- name: one
SELECT {{cols}} FROM tasks AS t WHERE t.id = %(id)s

-- name: two
SELECT {{cols}}, 1 FROM tasks AS t WHERE {where}
"""


def test_fragments_are_spliced_in_without_their_comments():
    queries = parse_named(FILE)
    assert queries["one"] == "SELECT t.id, t.queue FROM tasks AS t WHERE t.id = %(id)s\n"
    # Spliced mid-line: the fragment's comment must not swallow the rest of the line.
    assert queries["two"] == "SELECT t.id, t.queue, 1 FROM tasks AS t WHERE {where}\n"
    assert queries["two"].format(where="t.queue = 'q'").endswith("WHERE t.queue = 'q'\n")


def test_an_unknown_or_self_including_fragment_fails_at_load():
    with pytest.raises(RuntimeError, match="unknown fragment 'nope'"):
        parse_named("-- name: a\nSELECT {{nope}}\n")
    with pytest.raises(RuntimeError, match="includes itself"):
        parse_named("-- name: a\nSELECT {{b}}\n-- name: b\nSELECT {{a}}\n")


def test_a_name_defined_twice_or_an_empty_block_fails_at_load():
    with pytest.raises(RuntimeError, match="defined twice"):
        parse_named("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")
    with pytest.raises(RuntimeError, match="is empty"):
        parse_named("-- name: a\n\n-- name: b\nSELECT 2\n")
