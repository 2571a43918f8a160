"""The cluster's view of KV: every worker's KV events on the wire (publisher.py, subscriber.py,
vLLM's ZMQ protocol and format) and what they add up to (view.py)."""
