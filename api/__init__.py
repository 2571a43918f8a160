"""pdserve.api package."""
