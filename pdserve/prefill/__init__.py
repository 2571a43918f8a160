"""pdserve.prefill package."""
