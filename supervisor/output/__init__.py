"""supervisor/output."""
