"""The gRPC surface keeps the proto's promises: reflection v1 and v1alpha, the status codes
its comments document, fields named as the proto names them, and a client compiled from
the proto by grpcio-tools (not the project's stubs) in a process of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2

from pdserve.api import Client

PROTO = Path(__file__).resolve().parents[2] / "api" / "proto" / "pdserve" / "api" / "v1" / "inference.proto"


def reflect(channel, version: str, *requests):
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(call(iter(requests), timeout=30))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_services_and_builds_a_working_generate(worker, version):
    with grpc.insecure_channel(worker.grpc) as ch:
        listed, files = reflect(ch, version, reflection_pb2.ServerReflectionRequest(list_services=""),
                                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Inference"))
        names = {s.name for s in listed.list_services_response.service}
        assert names == {"pdserve.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                         "grpc.reflection.v1alpha.ServerReflection"}
        # A client that knows nothing but what reflection told it (as grpcurl does).
        pool = descriptor_pool.DescriptorPool()
        for raw in files.file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
        method = pool.FindServiceByName("pdserve.v1.Inference").methods_by_name["Generate"]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        gen = ch.unary_stream("/pdserve.v1.Inference/Generate", request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)
        req = req_cls(text="Hello", sampling={"max_tokens": 3, "temperature": 0.0})
        msgs = list(gen(req, timeout=60))
    assert sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].finish_reason == "length"


def test_reflection_v1_describes_itself(worker):
    with grpc.insecure_channel(worker.grpc) as ch:
        (resp,) = reflect(ch, "v1", reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    fdp = descriptor_pb2.FileDescriptorProto.FromString(resp.file_descriptor_response.file_descriptor_proto[0])
    assert fdp.package == "grpc.reflection.v1" and fdp.service[0].name == "ServerReflection"


@pytest.mark.parametrize("kwargs, code, field", [
    (dict(prompt="hi", model="other-model"), grpc.StatusCode.NOT_FOUND, "model"),
    (dict(prompt=[5, 10**8]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (dict(prompt=[5] * 600), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (dict(prompt="hi", logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
])
def test_status_codes_and_field_names_are_the_protos(worker, kwargs, code, field):
    with Client(worker.grpc) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(**kwargs)
    assert info.value.code() == code and info.value.details().startswith(f"{field}: "), info.value.details()


CLIENT = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
    import grpc
    import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
    out = {}
    with grpc.insecure_channel(sys.argv[1]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        out["models"] = [m.id for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models]
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True), priority=pb.PRIORITY_HIGH,
            route=pb.ROUTE_LOCAL)
        msgs = list(stub.Generate(req, timeout=60))
        out["tokens"] = [t for m in msgs for t in m.token_ids]
        out["top"] = [len(lp.top) for m in msgs for lp in m.logprobs]
        out["breakdown_route"] = msgs[-1].breakdown.route
        out["abort_unknown"] = stub.Abort(pb.AbortRequest(request_id="nobody"), timeout=30).found
        for name, r in (("unknown_model", pb.GenerateRequest(text="hi", model="nope")),
                        ("bad_top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2.0)))):
            try:
                list(stub.Generate(r, timeout=30))
                out[name] = "OK"
            except grpc.RpcError as exc:
                out[name] = [exc.code().name, exc.details()]
    print(json.dumps(out))
''')


def test_client_compiled_from_the_proto_by_grpcio_tools(worker, tmp_path):
    """A separate process, with stubs protoc makes here from the .proto alone."""
    shutil.copy(PROTO, tmp_path / "inference.proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", str(tmp_path / "inference.proto")], check=True)
    (tmp_path / "client.py").write_text(CLIENT)
    run = subprocess.run([sys.executable, "-I", "client.py", worker.grpc], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    with Client(worker.grpc) as c:
        ref = c.generate([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert out["models"] == ["llama"] and out["tokens"] == ref.token_ids
    assert out["top"] == [2, 2, 2, 2] and out["breakdown_route"] == "local" and out["abort_unknown"] is False
    assert out["unknown_model"][0] == "NOT_FOUND" and out["unknown_model"][1].startswith("model: ")
    assert out["bad_top_p"][0] == "INVALID_ARGUMENT" and out["bad_top_p"][1].startswith("top_p: ")
