"""child package: the worker process (`python -P -m child`)."""
__distribution__ = "layerwise-supervisor"  # the marker supervisor.provenance looks for; keep this exact line
