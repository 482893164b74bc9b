"""supervisor/workers."""
