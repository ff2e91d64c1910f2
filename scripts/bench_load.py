"""Load time of each weight format, jit compile time and forward time of the default model.

    python scripts/bench_load.py [--prompt-len 128] [--repeats 5]

Loads SmolLM2-135M-Instruct from its GGUF file, from a Hugging Face safetensors directory written
from the same weights (needs torch, a test extra), and from a jaxpage orbax checkpoint; then times
the cache-free forward of one prompt. Each load runs in a fresh process so no cache is shared.
The last line is one JSON object with every figure in seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD_SNIPPET = """
import json, sys, time
import jax
jax.devices()  # backend start-up is not part of a format's load time
from jaxpage.models import load_model
start = time.perf_counter()
config, params = load_model(sys.argv[1])
jax.block_until_ready(params)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def timed_load(source: Path) -> float:
    result = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, str(source)], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"loading {source} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def write_hf_directory(gguf_path: Path, directory: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses models loaded from GGUF: write what it would write by hand.
    directory.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(tensors, str(directory / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import jax
    import numpy as np

    from jaxpage.models import forward, load_model
    from jaxpage.models.default_model import default_model_path
    from jaxpage.models.orbax_checkpoint import save_checkpoint

    gguf_path = default_model_path()
    figures: dict[str, float | str | int] = {"backend": jax.default_backend(), "prompt_len": args.prompt_len}
    with tempfile.TemporaryDirectory() as tmp:
        config, params = load_model(gguf_path)
        save_checkpoint(Path(tmp) / "orbax", config, params)
        write_hf_directory(gguf_path, Path(tmp) / "hf")
        figures["load_gguf_s"] = timed_load(gguf_path)
        figures["load_safetensors_s"] = timed_load(Path(tmp) / "hf")
        figures["load_orbax_s"] = timed_load(Path(tmp) / "orbax")

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, args.prompt_len))
    start = time.perf_counter()
    jax.block_until_ready(forward(config, params, tokens))
    figures["first_forward_s"] = time.perf_counter() - start  # trace + compile + one run
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(forward(config, params, tokens))
        runs.append(time.perf_counter() - start)
    figures["forward_s"] = float(np.median(runs))
    figures["compile_s"] = figures["first_forward_s"] - figures["forward_s"]
    # 2 FLOPs per weight per token in the matmuls (the LM head included), attention excluded
    matmul_params = sum(x.size for x in jax.tree.leaves(params["layers"])) + params["embed_tokens"]["embedding"].size
    figures["forward_gflops_per_s"] = 2 * matmul_params * args.prompt_len / figures["forward_s"] / 1e9
    for key, value in figures.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
