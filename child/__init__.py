"""child package."""
