"""supervisor/live."""
