"""supervisor/commands."""
