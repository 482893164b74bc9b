"""supervisor/run."""
