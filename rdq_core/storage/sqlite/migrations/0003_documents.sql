-- Engine documents: small versioned JSON documents (bulk operations and their per-queue locks),
-- written by compare-and-set on version.
CREATE TABLE rdq_documents (
    kind    TEXT NOT NULL,
    key     TEXT NOT NULL,
    version INTEGER NOT NULL CHECK (version >= 1),
    body    TEXT NOT NULL,
    PRIMARY KEY (kind, key)
) WITHOUT ROWID;
