"""child/backends."""
