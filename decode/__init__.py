"""pdserve.decode package."""
