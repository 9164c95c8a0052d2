"""Engine pool and routing policies."""
