"""llama-server, built beside the bench's llama.cpp, for the API comparisons (docs/api.md).

    python scripts/bench_llamacpp/llama_server.py     # prints the llama-server binary's path

The bench's own build leaves the server out (`-DLLAMA_BUILD_SERVER=OFF`); this builds it in
its own directory of the cache (`build-server`: the native build's flags, no web UI, under
`nice -n 15`), so the bench's build is not touched.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import llamacpp

DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "meshd-llamacpp" / "0.3.36"
BUILD_DIR = "build-server"


def ensure_server(cache: pathlib.Path = DEFAULT_CACHE, jobs: int = 2) -> pathlib.Path:
    """The llama-server binary of `cache`'s llama.cpp, built if missing.

    A fresh build of ggml and libllama takes over an hour on this loaded 2-core machine, so
    the bench's native build directory is copied (absolute paths rewritten, every file's
    time kept so make sees ggml and libllama up to date), configured again with the server
    on, and only the server and what it adds (mtmd, httplib) are compiled (~15 min)."""
    source = llamacpp.source_in(cache)
    bench_build = cache / "build"
    if source is None or not (bench_build / "CMakeCache.txt").is_file():
        raise SystemExit(f"{cache}: no llama.cpp build (run scripts/bench_llamacpp first)")
    build = cache / BUILD_DIR
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if build.exists():
        shutil.rmtree(build)
    shutil.copytree(bench_build, build, symlinks=True)
    old, new = str(bench_build).encode(), str(build).encode()
    pattern = re.compile(re.escape(old) + rb"(?![-\w])")
    for path in build.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if old in data and b"\0" not in data:  # text files only
                stat = path.stat()
                path.write_bytes(pattern.sub(new, data))
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    log_path = cache / f"{BUILD_DIR}.log"
    llamacpp.log(f"building llama-server in {build} (nice -n 15, -j{jobs})")
    nice = ["nice", "-n", "15"]
    llamacpp.run_logged(
        [*nice, "cmake", "-S", str(source), "-B", str(build), "-DLLAMA_BUILD_SERVER=ON",
         "-DLLAMA_BUILD_UI=OFF"],
        log_path,
    )  # fmt: skip
    llamacpp.run_logged(
        [*nice, "cmake", "--build", str(build), f"-j{jobs}", "--target", "llama-server"],
        log_path,
    )
    return binary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    print(ensure_server(args.cache, args.jobs))


if __name__ == "__main__":
    main()
