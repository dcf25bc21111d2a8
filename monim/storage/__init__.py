"""Storage (layer 3): a memory on disk (its datastore of shards and manifest, the FAISS index, the
lexical index, the recorded settings, what was forgotten), the work directory's layout, the plan of
days to read, fsck, and a reader's check of a memory's files against their commit. Imports the layers below (core, data, lm)."""
