"""protocol/ must stay sans-IO: importing it must not pull in I/O or compute libraries."""

import ast
import pathlib
import subprocess
import sys

import protocol

FORBIDDEN = {"trio", "torch", "socket", "asyncio", "zeroconf", "httpx", "threading", "select"}


def test_no_module_in_protocol_imports_io() -> None:
    root = pathlib.Path(protocol.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in FORBIDDEN:
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_importing_every_protocol_module_loads_no_io_library() -> None:
    root = pathlib.Path(protocol.__file__).parent
    modules = [f"protocol.{p.stem}" for p in sorted(root.glob("*.py")) if p.stem != "__init__"]
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        f"bad = sorted(m for m in {sorted(FORBIDDEN)!r} if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # socket/select may be imported by the interpreter's own startup on some platforms;
    # the libraries that matter for sans-IO are the concurrency and compute ones.
    loaded = {m for m in out.stdout.strip().split(",") if m} - {"socket", "select", "threading"}
    assert loaded == set()
