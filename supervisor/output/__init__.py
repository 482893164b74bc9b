"""The output folder on disk: the journal of written parts, the lock, and finalize.

    lock.py      one supervisor per output folder (flock on OUT/.export/lock)
    journal.py   OUT/.export/journal.jsonl: the fingerprint, every part's record (fsync'd), resume and verify
    finalize.py  config.json, the shard index, the side files, the done marker

Owns the folder's layout rules as the supervisor writes them (shared.layout names the files); never starts a
process and never decides what to export next (supervisor.run does).
"""
