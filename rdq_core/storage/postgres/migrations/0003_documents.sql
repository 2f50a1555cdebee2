-- rdq schema v3: engine documents -- small versioned JSON documents (bulk operations and their
-- per-queue locks), written by compare-and-set on version.
--
-- A new table only: nothing existing is locked or rewritten. The body is kept as the JSON text
-- it was given (text, not jsonb, so it reads back byte for byte). Kind and key use the "C"
-- collation, so the primary key serves paging in key byte order whatever the database's locale.
CREATE TABLE rdq_documents (
    kind    text COLLATE "C" NOT NULL,
    key     text COLLATE "C" NOT NULL,
    version bigint NOT NULL,
    body    text NOT NULL,

    CONSTRAINT rdq_documents_pkey PRIMARY KEY (kind, key),
    CONSTRAINT rdq_documents_version_check CHECK (version >= 1)
);
