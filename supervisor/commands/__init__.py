"""What the CLI does beyond the API: `status`, `report`, `plan`, the progress display, `demo`, `verify --vllm`.

    status.py         an output folder's state, read-only (and the loader check, `python -m child.loadcheck`)
    report.py         the run report (tables, charts) from the journal
    planview.py       `supervisor plan`: the forecast as a table
    progress.py       the terminal's progress display from the events
    demo.py           `supervisor demo`: a small model built, exported, loaded back
    liblog.py         library output: logged helper processes, the --debug echo
    vllm_check.py     `verify --vllm`: runs vllm_generate.py (found beside it, by path) in the vLLM venv
    vllm_generate.py  a script for that venv; imports nothing of this package

Each is a thin shell over supervisor.api or the output folder; none is imported by an export's own path.
"""
