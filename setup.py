"""Build hook: the package list and the gRPC stubs.

pdserve is one import package, the folder pdserve/; its subpackages are the design card's
folders (pdserve/cluster, pdserve/engine, ...), each also reachable at the top of the checkout
by a link of its name (cluster -> pdserve/cluster). Every folder below pdserve/ with an
``__init__.py`` is a package, found here so that no package can be left out of the wheel by a
hand-kept list. The gRPC stubs are generated from pdserve/api/proto at build/install time,
never hand-edited or committed; `pip install .` and `pip install -e .` both run `build_py`,
which runs protoc (grpcio-tools) first. Everything else about the package lives in
pyproject.toml.
"""

import glob
import os
import shutil
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DATA = {
    "pdserve.api": ["proto/pdserve/api/v1/*.proto"],
    "pdserve.api.v1": ["*.pyi"],
    "pdserve.engine": ["csrc/*.c", "csrc/*.h"],
    "pdserve.configs": ["topologies/*.yaml", "router/*.yaml", "autoscale/*.yaml", "sim/*.yaml"],
    "pdserve.bench": ["policies/*.yaml"],
}


def discover_packages() -> list[str]:
    """pdserve and every folder below it with an __init__.py (the links at the top of the
    checkout are not packages of their own: only pdserve.* is)."""
    return sorted(["pdserve", *(f"pdserve.{sub}" for sub in find_packages(os.path.join(HERE, "pdserve")))])


PROTO_ROOT = os.path.join(HERE, "pdserve", "api", "proto")
# Protos under pdserve/api/v1 become modules of the `pdserve.api.v1` package (folder pdserve/api/v1).
PROTO_PACKAGE_DIR = os.path.join("pdserve", "api", "v1")
OUT_DIR = os.path.join(HERE, "pdserve", "api", "v1")


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc  # build requirement (pyproject [build-system])

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


setup(
    packages=discover_packages(),
    package_data=PACKAGE_DATA,
    cmdclass={"build_py": BuildPyWithProtos},
)
