"""Worker processes on this host: their start, pipes, log pumps, heartbeats, stop, and the devices they run on.

    devices.py   which GPUs and how many workers, threads per worker, the child's environment (CUDA_VISIBLE_DEVICES)
    zygote.py    the warm parent that imports the libraries once and forks workers (kept warm between runs)
    worker.py    one child: Hello/Ready, requests with a heartbeat watch, WorkerLost, stop (SIGTERM, SIGKILL)
    handle.py    the process-handle protocol (Popen, Forked, RemoteProc) and the pumped launch
    logpump.py   a child's stdout/stderr into its log file and LogLine events
    group.py     a calibrated group: W workers that calibrate each layer together, one worker to the scheduler

Owns processes and their file descriptors; never decides about retries (supervisor.run.scheduler), never journals,
never imports torch or Ray (a remote worker is supervisor.cluster's).
"""
