"""Generated gRPC stubs for pdserve/api/v1/*.proto (made at build time by setup.py)."""
