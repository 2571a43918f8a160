"""pdserve.api: the Inference gRPC API (proto, generated stubs) and its Python client; the
serving surface a decode worker and a gateway share (the gRPC server `grpc_service`, the
OpenAI HTTP app `http_app`, the `Surface` both call, the request vocabulary `ingress`).

The stubs in ``pdserve.api.v1`` are generated from ``api/proto`` when the
package is built or installed (``pip install -e .`` runs protoc).
"""

try:
    from .client import AsyncClient, Client, Completion, build_request
except ImportError as exc:  # stubs missing: the package was not installed
    if "inference_pb2" not in str(exc):
        raise
    raise ImportError(
        "pdserve.api stubs are not generated; install the package (pip install -e .) "
        "so that setup.py runs protoc on api/proto"
    ) from exc

__all__ = ["Client", "AsyncClient", "Completion", "build_request"]
