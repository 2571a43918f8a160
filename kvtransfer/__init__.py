"""pdserve.kvtransfer package."""
