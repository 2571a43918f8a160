"""The kvindex tests: KV events from real engine processes (kv_worker.py) to subscribers."""

import sys
from pathlib import Path

# Spawned children import the worker by module name; they inherit sys.path.
sys.path.insert(0, str(Path(__file__).parent))
