"""child/sources."""
