"""supervisor/checks."""
