"""pdserve.common: the vocabulary every layer shares (no imports beyond the standard library).

It sits below every other folder: the engine, the router, the control plane,
both workers and the API layer may import it, and it imports none of them.
"""

from .priority import Priority

__all__ = ["Priority"]
