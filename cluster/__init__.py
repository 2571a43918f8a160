"""pdserve.cluster package."""
