"""The front door for many decode workers (`pdserve gateway`): the same gRPC and HTTP APIs
as a decode worker, each request sent to the worker with the lowest predicted TTFT, and a
stream whose worker fails continued on another one (docs/gateway.md)."""
