"""A run on a Ray cluster: seats, node hosts, the TCP listener remote workers connect back to.

    seats.py       Cluster: join Ray, one seat (actor) per worker slot, a node host per node, the probe that
                   every node sees the source and the output on the shared file system
    node_agent.py  the node host (a Ray actor): a warm parent on its node, starts and signals its workers;
                   Ray pickles its classes by module path (supervisor.cluster.node_agent)
    remote.py      the run's Listener (one TCP port, the handshake) and RemoteWorker / RemoteProc
    channel.py     both ends prove the run's secret without sending it, inside TLS where Ray uses TLS

Ray is imported only here, and only for `[resources] cluster = "ray"`. Never decides about retries (the scheduler
does) and never writes the output itself (the workers write shards on the shared file system).
"""
