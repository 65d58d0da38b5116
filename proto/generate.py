"""Regenerates the committed Python stubs from `scheduler.proto`.

Run `python -m luftpause.proto.generate` after editing the .proto; `tests/proto` fails while the
committed stubs differ from what this produces. grpc_tools writes bare `import scheduler_pb2`
lines, which only work with the folder on sys.path, so the import is rewritten to the package's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = ("scheduler_pb2.py", "scheduler_pb2.pyi", "scheduler_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Writes the three stub files for `scheduler.proto` into `out_dir`."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    args = [
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / "scheduler.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on scheduler.proto")
    grpc_stub = out_dir / "scheduler_pb2_grpc.py"
    grpc_stub.write_text(
        grpc_stub.read_text().replace(
            "import scheduler_pb2 as", "from luftpause.proto import scheduler_pb2 as"
        )
    )


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in STUBS:
            (HERE / name).write_bytes((Path(tmp) / name).read_bytes())
    print(f"wrote {', '.join(STUBS)} in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
