"""Generates orchestrator_client/_proto/ from the repository's proto/orchestrator.proto with
grpcio-tools while the package is built, so the stubs always match the binaries built from the
same checkout (ORCHESTRATOR_PROTO names another .proto file)."""

import os
import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def proto_file() -> Path:
    path = Path(os.environ.get("ORCHESTRATOR_PROTO", HERE.parent / "proto" / "orchestrator.proto"))
    if not path.is_file():
        raise SystemExit(f"orchestrator-client: {path} not found (build from the repository checkout, or set ORCHESTRATOR_PROTO)")
    return path


def generate(out: Path) -> None:
    from grpc_tools import protoc

    proto = proto_file()
    out.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{proto.parent}", f"--python_out={out}", f"--grpc_python_out={out}", str(proto)]
    if protoc.main(args) != 0:
        raise SystemExit(f"orchestrator-client: protoc failed on {proto}")
    # The generated stub imports its messages as a top-level module: make it package-relative.
    grpc_file = out / f"{proto.stem}_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(re.sub(rf"^import {proto.stem}_pb2 as", f"from . import {proto.stem}_pb2 as", text, flags=re.M))


class BuildWithStubs(build_py):
    def run(self):
        generate(Path(self.build_lib) / "orchestrator_client" / "_proto")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
