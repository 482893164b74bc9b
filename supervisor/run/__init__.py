"""One export's control flow, from a validated Plan to its terminal event.

    plan.py        Plan: what api.prepare hands over
    sequence.py    Run: the sequence (start, the export, record, finalize, cleanup), on a thread of its own
    launch.py      the slots, the warm parent, a ready worker (or group) per slot, the GPU room check
    scheduler.py   parts to slots: retries, recycling, timeouts, the verdict's wait, elastic cluster slots
    verdict.py     the export plan judged by a worker (Describe), the non-layer part copied ahead of it
    verbatim.py    that copy: the non-layer tensors written as they are, when the export keeps them so
    boundaries.py  a calibrated export's boundaries (a layer's inputs on disk) and arithmetic
    feed.py        the events, the children's log lines, the progress clock
    quality.py     `verify --quality` and `[evaluate]`: the finished export against its source, layer by layer in a
                   quality worker, its own journal under .export/quality (resumable)

Run builds each helper with what it needs (the plan, an emit function, the cancel token); none calls back into
Run. Never validates a job (supervisor.checks, through api.prepare), never quantizes (the child does).
"""
