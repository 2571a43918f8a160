"""Build hook: generate the gRPC stubs from api/proto at build/install time.

Everything else about the package lives in pyproject.toml. The stubs are
never hand-edited or committed; `pip install .` and `pip install -e .` both
run `build_py`, which runs protoc (grpcio-tools) first.
"""

import glob
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(HERE, "api", "proto")
# Protos under pdserve/api/v1 become modules of the `pdserve.api.v1` package (folder api/v1).
PROTO_PACKAGE_DIR = os.path.join("pdserve", "api", "v1")
OUT_DIR = os.path.join(HERE, "api", "v1")


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement (pyproject [build-system])
    import grpc_tools

    protos = sorted(glob.glob(os.path.join(PROTO_ROOT, PROTO_PACKAGE_DIR, "*.proto")))
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        os.makedirs(OUT_DIR, exist_ok=True)
        for path in glob.glob(os.path.join(tmp, PROTO_PACKAGE_DIR, "*")):
            shutil.copy(path, OUT_DIR)


class BuildPyWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
