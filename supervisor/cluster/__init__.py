"""supervisor/cluster."""
