"""Build hook: the package layout and the gRPC stubs.

pdserve is one import package whose subpackages are the repository's top-level
folders (PACKAGE_DIRS); every folder below them with an ``__init__.py`` is a
package too, found here so that no package can be left out of the wheel by a
hand-kept list. The gRPC stubs are generated from api/proto at build/install
time, never hand-edited or committed; `pip install .` and `pip install -e .`
both run `build_py`, which runs protoc (grpcio-tools) first. Everything else
about the package lives in pyproject.toml.
"""

import glob
import os
import shutil
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# subpackage -> folder (relative to this file)
PACKAGE_DIRS = {
    "pdserve": "pdserve",
    "pdserve.common": "common",
    "pdserve.engine": "engine",
    "pdserve.kvtransfer": "kvtransfer",
    "pdserve.router": "router",
    "pdserve.cluster": "cluster",
    "pdserve.prefill": "prefill",
    "pdserve.decode": "decode",
    "pdserve.gateway": "gateway",
    "pdserve.sim": "sim",
    "pdserve.api": "api",
    "pdserve.bench": "bench",
    "pdserve.configs": "configs",
}
PACKAGE_DATA = {
    "pdserve.api": ["proto/pdserve/api/v1/*.proto"],
    "pdserve.api.v1": ["*.pyi"],
    "pdserve.engine": ["csrc/*.c"],
    "pdserve.configs": ["topologies/*.yaml", "router/*.yaml", "autoscale/*.yaml", "sim/*.yaml"],
    "pdserve.bench": ["policies/*.yaml"],
}


def discover_packages() -> list[str]:
    """Every package: the mapped folders and each folder below them with an __init__.py."""
    found = []
    for name, folder in PACKAGE_DIRS.items():
        root = os.path.join(HERE, folder)
        if not os.path.isfile(os.path.join(root, "__init__.py")):
            raise RuntimeError(f"{folder}/ is mapped to {name} but has no __init__.py")
        found.append(name)
        # pdserve/ holds a link to each subpackage's folder (for tools reading the tree,
        # docs/architecture.md "Layout"): those are found through their own mapping, not the link
        links = [f"{sub.split('.', 1)[1]}*" for sub in PACKAGE_DIRS if name == "pdserve" and sub != "pdserve"]
        found += [f"{name}.{sub}" for sub in find_packages(root, exclude=links)]
    return sorted(found)
PROTO_ROOT = os.path.join(HERE, "api", "proto")
# Protos under pdserve/api/v1 become modules of the `pdserve.api.v1` package (folder api/v1).
PROTO_PACKAGE_DIR = os.path.join("pdserve", "api", "v1")
OUT_DIR = os.path.join(HERE, "api", "v1")


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
    package_dir=PACKAGE_DIRS,
    package_data=PACKAGE_DATA,
    cmdclass={"build_py": BuildPyWithProtos},
)
