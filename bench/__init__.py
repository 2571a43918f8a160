"""pdserve.bench package."""
