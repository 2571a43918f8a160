"""pdserve.router package."""
