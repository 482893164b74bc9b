"""shared package: what the supervisor and the child both use (protocol, job, layout)."""
__distribution__ = "layerwise-supervisor"  # the marker supervisor.provenance looks for; keep this exact line
