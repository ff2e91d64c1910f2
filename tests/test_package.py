"""The package's import surface: vLLM's names from `jaxpage`, imported lazily, and the version; what imports torch
(only the tests that compare with Hugging Face transformers)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jaxpage

VLLM_NAMES = {
    "LLM": "jaxpage.entrypoints.llm",
    "SamplingParams": "jaxpage.sampling_params",
    "StructuredOutputsParams": "jaxpage.sampling_params",
    "LLMEngine": "jaxpage.engine.llm_engine",
    "EngineConfig": "jaxpage.config",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
}

# Run in a fresh interpreter: what `import jaxpage` imports, then whether vLLM's names resolve to their classes.
PROBE = """
import importlib, json, sys

import jaxpage

heavy = [m for m in ("jax", "transformers", "torch") if m in sys.modules]
from jaxpage import LLM, SamplingParams, StructuredOutputsParams, LLMEngine, EngineConfig
from jaxpage import RequestOutput, CompletionOutput

resolved = {name: globals()[name] is getattr(importlib.import_module(module), name) for name, module in NAMES.items()}
print(json.dumps({"heavy": heavy, "resolved": resolved, "jax": "jax" in sys.modules}))
"""


def test_import_is_light_and_vllm_names_resolve_lazily():
    probe = f"NAMES = {VLLM_NAMES!r}\n{PROBE}"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["heavy"] == []  # `import jaxpage` imports neither jax nor transformers nor torch
    assert report["resolved"] == dict.fromkeys(VLLM_NAMES, True)
    assert report["jax"]  # LLM and LLMEngine need jax: they were imported on demand


def test_public_names():
    assert set(VLLM_NAMES) <= set(jaxpage.__all__)
    for name in jaxpage.__all__:
        assert getattr(jaxpage, name) is not None
    assert set(jaxpage.__all__) <= set(dir(jaxpage))
    assert jaxpage.ModelLoadError.__module__ == "jaxpage.errors"


def test_unknown_names_fail_as_usual():
    with pytest.raises(ImportError, match="cannot import name 'Nonexistent' from 'jaxpage'"):
        from jaxpage import Nonexistent  # noqa: F401
    with pytest.raises(AttributeError, match="module 'jaxpage' has no attribute 'Nonexistent'"):
        jaxpage.Nonexistent  # noqa: B018
    assert not hasattr(jaxpage, "nonexistent")


def test_version_is_the_installed_distributions():
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert jaxpage.__version__ == pyproject["project"]["version"]


def test_benchmark_helpers_import_no_torch():
    import jaxpage.benchmarks

    modules = [f"jaxpage.benchmarks.{m.name}" for m in pkgutil.iter_modules(jaxpage.benchmarks.__path__)]
    probe = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
    probe += 'print([m for m in ("torch", "transformers", "jax") if m in sys.modules])'
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(modules) >= 5 and result.stdout.split() == ["[]"]


HOST_MODULES = [
    "jaxpage.engine.block_manager",
    "jaxpage.engine.scheduler",
    "jaxpage.sequence",
    "jaxpage.sampling_params",
    "jaxpage.validation",
    "jaxpage.config",
    "jaxpage.config.speculative",
    "jaxpage.spec_decode.ngram",
    "jaxpage.spec_decode.stats",
    "jaxpage.spec_decode.drafter",
    "jaxpage.spec_decode.policy",
    "jaxpage.worker.step_shapes",
    "jaxpage.engine.replica",
    "jaxpage.engine.output_processor",
]


def test_host_bookkeeping_imports_no_jax():
    # The scheduler's side stays plain Python (and numpy), so that its tests are fast and property-based.
    probe = f"import importlib, sys\nfor m in {HOST_MODULES!r}: importlib.import_module(m)\n"
    probe += 'print([m for m in ("torch", "transformers", "jax") if m in sys.modules])'
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]


TESTS = Path(__file__).parent
HF_MODULES = {"hf_reference", "torch", "transformers"}


def modules_comparing_with_hf() -> set[str]:
    """The test modules that import hf_reference, torch or transformers, directly or through another test module."""
    imports = {}
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imports[path.stem] = {name.split(".")[0] for name in names}
    comparing = {name for name, imported in imports.items() if imported & HF_MODULES}
    while more := {name for name, imported in imports.items() if imported & comparing} - comparing:
        comparing |= more
    return comparing


# Run in a fresh interpreter from the repository root: collect the given test modules (which imports conftest and
# each module), then run a test that asks for the torch-free model fixtures; print whether torch was imported.
TORCH_PROBE = """
import sys
import pytest

collected = pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", *sys.argv[2:]])
after_collection = "torch" in sys.modules
sys.path.insert(0, "tests")
ran = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "conftest", sys.argv[1]])
print({"collected": int(collected), "ran": int(ran), "torch": [after_collection, "torch" in sys.modules]})
"""

FIXTURE_TEST = """
def test_model_fixtures(tiny_model_path, tiny_dir):
    pass
"""


def test_tests_that_do_not_compare_with_transformers_import_no_torch(tmp_path):
    comparing = modules_comparing_with_hf()
    assert {"test_model_parity", "test_gguf", "test_gguf_tokenizer", "test_engine"} <= comparing
    others = sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.glob("test_*.py") if p.stem not in comparing)
    assert {"tests/test_scheduler.py", "tests/test_llm_api.py", "tests/test_load_errors.py"} <= set(others)
    (tmp_path / "test_fixtures.py").write_text(FIXTURE_TEST)
    result = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, str(tmp_path / "test_fixtures.py"), *others],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = ast.literal_eval(result.stdout.splitlines()[-1])
    assert report == {"collected": 0, "ran": 0, "torch": [False, False]}, result.stdout[-3000:]


ROOT = TESTS.parent


def project_modules() -> dict[str, Path]:
    """{module name: its file} of every module in jaxpage/ and pallas_kernels/ (a package by its own name)."""
    paths = [*ROOT.glob("jaxpage/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}


def absolute_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, the names imported from it; [] for `import module`) of every absolute import in the file, at the top
    of the module or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_every_runtime_import_is_a_declared_dependency():
    # What jaxpage/ and pallas_kernels/ import, at the top of a module or inside a function, is the standard library,
    # the project itself, or a distribution pyproject.toml's dependencies name. Not jaxpage/benchmarks/, whose
    # helpers import the test and bench extras (torch, matplotlib) when a script or a test calls them.
    import importlib.metadata
    import re

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

    def normalized(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    declared = {normalized(re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0]) for d in pyproject["project"]["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for name, path in project_modules().items():
        if name.startswith("jaxpage.benchmarks"):
            continue
        for module, _ in absolute_imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in ("jaxpage", "pallas_kernels", "__future__"):
                continue
            if not {normalized(d) for d in distributions.get(top, [top])} & declared:
                undeclared.setdefault(top, str(path.relative_to(ROOT)))
    assert undeclared == {}


def test_no_import_circle():
    # Every import between the project's modules (at the top of a module or inside a function): no module reaches
    # itself. `from package import submodule` is an import of the submodule.
    modules = project_modules()
    imports = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in absolute_imports(path):
            submodules = [f"{module}.{n}" for n in names]
            targets = [m for m in submodules if m in modules]
            if len(targets) < len(submodules) or not names:
                targets.append(module)
            imports[name] |= {target for target in targets if target in modules and target != name}

    def circle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def visit(module: str) -> list[str] | None:
            for target in sorted(imports[module]):
                if target == start:
                    return [*path, start]
                if target not in seen:
                    seen.add(target)
                    path.append(target)
                    if found := visit(target):
                        return found
                    path.pop()
            return None

        return visit(start)

    circles = [circle for name in sorted(modules) if (circle := circle_from(name))]
    assert circles == []


def test_no_class_over_300_lines_and_no_function_over_80():
    # The engine core stays in units one can read (issue 27): in jaxpage/, no class over 300 lines and no function
    # over 80 (nested ones counted in their own right). The Pallas kernel bodies in pallas_kernels/ are not held to it.
    too_long = []
    for name, path in project_modules().items():
        if not name.startswith("jaxpage"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if (
                isinstance(node, ast.ClassDef)
                and lines > 300
                or (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > 80)
            ):
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert too_long == []


def test_only_the_scheduler_writes_a_sequence():
    # One writer per piece of state (issue 27): a Sequence's tokens, computed counts and status are written by the
    # scheduler (schedule, launched, update_from_output) and the block manager it owns (counts as pages are matched,
    # forked or freed), nowhere else: not the engine, the output processor, the proposers or the runners.
    fields = {
        *("token_ids", "num_computed_tokens", "num_draft_computed_tokens", "num_pending_tokens"),
        *("status", "block_table", "group"),
    }
    writers = set()
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "append_token":
                    writers.add(name)
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and element.attr in fields:
                        owner = element.value
                        if not (isinstance(owner, ast.Name) and owner.id == "self"):  # a Sequence's own fields
                            writers.add(name)
    assert writers <= {"jaxpage.engine.scheduler", "jaxpage.engine.block_manager", "jaxpage.engine.input_processor"}
