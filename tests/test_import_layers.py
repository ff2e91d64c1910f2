"""The house has no upward arrow (issue 43): every import between jaxpage's packages and top-level modules, and
pallas_kernels/, points down one layer order; no file in jaxpage/ is over 600 lines; no module stands in for a moved
one.

The order is ../shared/DESIGN.md's shape (entrypoints > engine > worker > sample > spec_decode > structured >
tokenizers > attention > models > sources > config > pallas_kernels), with the top-level modules placed and two
differences, each said where it is below. Imports are read from the source (ast), every one: at the top of a module,
inside a function (lazy), under `if TYPE_CHECKING:`, relative ones resolved, `from package import submodule` as an
import of the submodule, and the module names jaxpage/__init__'s lazy names resolve to (PEP 562).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent

# Highest first: a module may import from its own unit and from the units below it, never from one above. A unit is a
# package or a top-level module; a module belongs to the longest unit its name starts with. "jaxpage" is only the
# package's own __init__.
LAYERS = [
    "jaxpage",  # the public face: vLLM's names (`from jaxpage import LLM`), imported lazily from every layer below
    "jaxpage.__main__",  # `python -m jaxpage`: the CLI
    # Tools, not the serving path (nothing below imports them): the programs built ahead of time for chips this host
    # lacks, and what the scripts share.
    "jaxpage.aot",
    "jaxpage.benchmarks",
    "jaxpage.entrypoints",  # LLM, CLI, server, batch jobs, OpenAI protocol, async engine, metrics
    "jaxpage.engine",  # scheduler, block manager, replicas, the step pipeline, SpeculativeDecoder (engine/spec_decoder)
    # DESIGN.md lists spec_decode below worker and sample; in the code it is above both: its proposers read Sequences
    # (jaxpage.sequence, above sample/ because a sequence holds its LogitsControls) and its policy prices verification
    # in the worker's StepShapes, while nothing in worker/ or sample/ needs it since the draft model's runner (a
    # ModelRunner the executor holds) lives in worker/ and the rejection sampling in sample/ (where DESIGN.md puts it).
    "jaxpage.spec_decode",
    "jaxpage.worker",  # the executor, model runners, step inputs and shapes, pool, compilation cache, mesh, hosts
    # DESIGN.md counts the sequences among the engine's host state; worker/ and spec_decode/ read them, so they sit
    # below both, as a top-level module.
    "jaxpage.sequence",
    "jaxpage.sample",  # sampler, logits processors (and their host-side controls), rejection sampling
    "jaxpage.structured",  # grammar matchers and their bitmasks
    "jaxpage.tokenizers",
    "jaxpage.attention",  # one class per backend, and the factory
    "jaxpage.models",
    "jaxpage.pooling",  # poolers over a pooling model's hidden states
    "jaxpage.sources",  # where a model comes from: a local path or a Hub id (huggingface_hub)
    # Plain modules that import nothing of jaxpage above them (or nothing at all): the chips aot builds for, the KV
    # pool's arrays, the mesh's axes, what a request asks and gets.
    "jaxpage.targets",
    "jaxpage.kv_cache",
    "jaxpage.mesh_axes",
    "jaxpage.outputs",
    "jaxpage.lora_request",
    "jaxpage.sampling_params",
    "jaxpage.pooling_params",
    "jaxpage.config",  # engine arguments, sub-configs, model configs and their readers, the speculative config
    "jaxpage.errors",
    "jaxpage.validation",
    "jaxpage.version",
    "pallas_kernels",  # a package of its own: it imports nothing of jaxpage
]
RANK = {unit: rank for rank, unit in enumerate(LAYERS)}

MAX_LINES = 600


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """{module name: its file} of every module in jaxpage/ and pallas_kernels/ under root."""
    paths = [*root.glob("jaxpage/**/*.py"), *root.glob("pallas_kernels/**/*.py")]
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) of every import in the file of module `name`, wherever it stands in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module, level - 1 packages up
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules]
            found += [(target, node.lineno) for target in submodules or [module]]
        elif isinstance(node, ast.Assign) and name == "jaxpage":  # the face's lazy names: {name: module}
            if any(isinstance(t, ast.Name) and t.id == "_LAZY_NAMES" for t in node.targets):
                found += [(value.value, value.lineno) for value in node.value.values]
    return found


def unit_of(module: str) -> str | None:
    """The unit of LAYERS the module belongs to; None for a module outside jaxpage and pallas_kernels."""
    if module == "jaxpage":
        return "jaxpage"
    units = [unit for unit in LAYERS[1:] if module == unit or module.startswith(unit + ".")]
    if not units:
        assert module.split(".")[0] not in ("jaxpage", "pallas_kernels"), f"{module} is in no layer of LAYERS"
        return None
    return max(units, key=len)


def upward_imports(root: Path = ROOT) -> list[str]:
    modules = project_modules(root)
    upward = []
    for name, path in sorted(modules.items()):
        source = unit_of(name)
        for target, line in imports_of(name, path, modules):
            unit = unit_of(target)
            if unit is not None and unit != source and RANK[unit] < RANK[source]:
                upward.append(f"{name} -> {target} ({path.relative_to(root)}:{line}): {source} is below {unit}")
    return upward


def test_every_module_has_a_layer():
    for name in project_modules():
        assert unit_of(name) is not None


def test_no_import_goes_up_a_layer():
    assert upward_imports() == []


def test_the_walk_sees_every_kind_of_import(tmp_path):
    # The walk itself, on a made-up tree: lazy, TYPE_CHECKING, relative and `from package import module` imports are
    # each seen, and each one here goes up.
    files = {
        "jaxpage/__init__.py": '_LAZY_NAMES = {"LLM": "jaxpage.entrypoints.llm"}\n',
        "jaxpage/config/__init__.py": "",
        "jaxpage/config/model.py": "def f():\n    from jaxpage.engine import scheduler\n",
        "jaxpage/config/speculative.py": "import typing\nif typing.TYPE_CHECKING:\n    from .. import sample\n",
        "jaxpage/engine/__init__.py": "",
        "jaxpage/engine/scheduler.py": "",
        "jaxpage/sample/__init__.py": "",
        "jaxpage/models/__init__.py": "from ..attention.xla import XlaAttention\n",
        "jaxpage/attention/xla.py": "",
        "pallas_kernels/impl.py": "import jaxpage.errors\n",
    }
    for file, text in files.items():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text(text)
    found = {line.split(" (")[0] for line in upward_imports(tmp_path)}
    assert found == {
        "jaxpage.config.model -> jaxpage.engine.scheduler",
        "jaxpage.config.speculative -> jaxpage.sample",
        "jaxpage.models -> jaxpage.attention.xla",
        "pallas_kernels.impl -> jaxpage.errors",
    }


def test_no_file_in_jaxpage_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.glob("jaxpage/**/*.py") if (n := len(p.read_text().splitlines()))}
    assert {file: n for file, n in long.items() if n > MAX_LINES} == {}


def test_no_module_stands_in_for_a_moved_one():
    # A moved module's old path goes when it moves (README, tests and scripts use the new one): no module replaces
    # itself in sys.modules with another.
    assert [name for name, path in project_modules().items() if "sys.modules[__name__]" in path.read_text()] == []
