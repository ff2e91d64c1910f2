"""What jaxpage's Pallas GPU kernels cost on the chip, read from a compile for it: no device, no device time.

XLA's GPU compiler, given a dump directory (the compiler option `xla_dump_to`), writes there the program's thunk
sequence (`module_NNNN.NAME.thunk_sequence.txt`: a line per kernel launch with its grid, block and shared memory)
and the PTX of each Triton kernel (`module_NNNN.NAME.K.ptx`, one entry function; a kernel that several layers launch
alike is compiled once). `read_dump` takes the launches of jaxpage's kernels (names starting with KERNEL_PREFIX, the
pallas_call names) from the one, assembles the other with ptxas (`-O3` for the PTX's own target, as XLA does: its
registers, stack frame and spills) and disassembles it with cuobjdump (counts of the SASS instructions that matter,
SASS_COUNTS), once per distinct PTX, and reports each kernel launch configuration (`KernelReport`), with the blocks
of it an SM holds at once (`blocks_per_sm`).

The tools come from NVIDIA's pip packages (ptxas: nvidia-cuda-nvcc-cu12; cuobjdump: nvidia-cuda-cuobjdump, which
runs nvdisasm: nvidia-cuda-nvdisasm), which `pip install 'jaxpage[compile]'` installs, else from PATH (`find_tool`).
The parsers (`launches`, `ptxas_info`, `sass_opcodes`, `sass_counts`, `blocks_per_sm`) are pure functions of the
tools' text.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNEL_PREFIX = "jaxpage_gpu_"  # the pallas_call names of pallas_kernels/gpu_*.py
TOOLS = ("ptxas", "cuobjdump")
# SASS counted per kernel (each instruction of the code once, not as often as it runs): the matrix products on the
# tensor cores (HMMA: mma.sync of 16-bit floats; HGMMA: Hopper's warpgroup wgmma; IMMA/IGMMA: of 8-bit integers;
# QGMMA: of fp8), float32 fused multiply-adds (products off the tensor cores, and softmax arithmetic), local memory
# (LDL/STL: spills and arrays the registers cannot hold), global loads by width in bits (LDG.8 ... LDG.128), copies
# from global to shared memory that bypass the registers (LDGSTS: cp.async) and Hopper's tensor memory accelerator
# (UTMALDG: a TMA tile load; UBLKCP: cp.async.bulk).
TENSOR_CORE_MMA = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA")
LOAD_WIDTHS = ("LDG.8", "LDG.16", "LDG.32", "LDG.64", "LDG.128")
SASS_COUNTS = (*TENSOR_CORE_MMA, "FFMA", "LDL", "STL", *LOAD_WIDTHS, "LDGSTS", "UTMALDG", "UBLKCP")


class MissingToolError(RuntimeError):
    """ptxas or cuobjdump is not installed."""


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """What one SM holds at once (compute capability 9.0's figures, Hopper; `from_target_config` reads those a
    GpuTargetConfigProto has)."""

    registers: int = 65536  # 32-bit registers
    register_unit: int = 256  # registers are allocated per warp, in units of this many
    shared_bytes: int = 233472  # shared memory of the SM (228 KiB) ...
    shared_per_block_optin: int = 232448  # ... of one block at most (227 KiB)
    shared_reserved_per_block: int = 1024  # the system's share of each block's shared memory
    shared_unit: int = 128  # shared memory is allocated in units of this many bytes
    threads: int = 2048
    warp_size: int = 32
    blocks: int = 32

    @classmethod
    def from_target_config(cls, text: str) -> SmLimits:
        """The limits with those of a GpuTargetConfigProto in text format (jaxpage.targets.Target.gpu_target_config)
        that it gives: registers_per_core_limit, shared_memory_per_core, shared_memory_per_block_optin,
        threads_per_core_limit and threads_per_warp; the others are compute capability 9.0's."""
        fields = dict(re.findall(r"^\s*(\w+): (\d+)\s*$", text, re.MULTILINE))
        names = dict(
            registers="registers_per_core_limit",
            shared_bytes="shared_memory_per_core",
            shared_per_block_optin="shared_memory_per_block_optin",
            threads="threads_per_core_limit",
            warp_size="threads_per_warp",
        )
        return cls(**{ours: int(fields[theirs]) for ours, theirs in names.items() if theirs in fields})


@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel launch of a thunk sequence."""

    name: str
    grid: tuple[int, int, int]  # blocks
    threads: tuple[int, int, int]  # threads of a block
    shared_bytes: int  # dynamic shared memory of a block


@dataclasses.dataclass(frozen=True)
class PtxasInfo:
    """ptxas' figures for one entry function."""

    registers: int  # per thread
    stack_bytes: int  # per thread: the stack frame (spills and local arrays) in local memory
    spill_store_bytes: int
    spill_load_bytes: int


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One of jaxpage's GPU kernels in a program, as launched `count` times alike (same code, grid and block)."""

    name: str  # the kernel's (pallas_call's) name
    count: int  # its launch sites in the program's thunk sequence: one per layer (a loop's body once, each branch of
    # a conditional once)
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_bytes: int  # per block
    registers: int  # per thread
    stack_bytes: int  # per thread
    spill_store_bytes: int
    spill_load_bytes: int
    blocks_per_sm: int  # resident at once (0: cannot launch)
    sass: dict[str, int]  # SASS_COUNTS' instructions in its code
    arch: str  # the PTX's target ("sm_90a")
    # Distinct codes of that name and block in the program (XLA names a second variant of a kernel NAME__1, so this is
    # 1 but where a dump differs): when > 1, each code is reported with every launch of the name.
    codes: int = 1

    @property
    def tensor_core_mma(self) -> int:
        """Its matrix-product instructions on the tensor cores (TENSOR_CORE_MMA)."""
        return sum(self.sass.get(op, 0) for op in TENSOR_CORE_MMA)


_LAUNCH = re.compile(
    r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes"
)


def launches(thunk_sequence: str) -> list[Launch]:
    """The kernel launches of a thunk sequence (`*.thunk_sequence.txt` of an XLA GPU dump), in its order."""
    found = []
    for line in thunk_sequence.splitlines():
        match = _LAUNCH.search(line)
        if match:
            name, *numbers = match.groups()
            n = [int(x) for x in numbers]
            found.append(Launch(name, tuple(n[0:3]), tuple(n[3:6]), n[6]))
    return found


def ptx_entries(ptx: str) -> list[str]:
    """The names of the entry functions (kernels) of a PTX module."""
    return re.findall(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", ptx, re.MULTILINE)


def ptx_arch(ptx: str) -> str:
    """The target of a PTX module (its `.target` directive, "sm_90a")."""
    match = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    if match is None:
        raise ValueError("a PTX module without a .target directive")
    return match.group(1)


def ptx_block(ptx: str, entry: str) -> tuple[int, int, int] | None:
    """The block size an entry function requires (`.reqntid`), None where it requires none."""
    start = re.search(rf"\.entry\s+{re.escape(entry)}\s*\(", ptx)
    if start is None:
        raise ValueError(f"no entry function {entry} in the PTX module")
    parameters_end = ptx.index(")", start.end())
    directives = ptx[parameters_end : ptx.index("{", parameters_end)]  # between the parameters and the body
    reqntid = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
    if reqntid is None:
        return None
    x, y, z = (int(v) if v else 1 for v in reqntid.groups())
    return x, y, z


def ptxas_info(output: str) -> dict[str, PtxasInfo]:
    """Each entry function's figures from `ptxas -v`'s output (its stderr): "Compiling entry function 'NAME'",
    then "Function properties for NAME" with "N bytes stack frame, N bytes spill stores, N bytes spill loads"
    (printed for callees too, under their own names) and "Used N registers"."""
    entry = properties_of = None
    registers: dict[str, int] = {}
    stacks: dict[str, tuple[int, int, int]] = {}
    entries = []
    for line in output.splitlines():
        if match := re.search(r"Compiling entry function '([^']+)'", line):
            entry = match.group(1)
            entries.append(entry)
        elif match := re.search(r"Function properties for (\S+)", line):
            properties_of = match.group(1)
        elif match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stacks[properties_of] = tuple(int(x) for x in match.groups())
        elif (match := re.search(r"Used (\d+) registers", line)) and entry is not None:
            registers[entry] = int(match.group(1))
    return {name: PtxasInfo(registers[name], *stacks.get(name, (0, 0, 0))) for name in entries if name in registers}


_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)")
# "/*0090*/  @!P0 LDG.E.128 R4, desc[UR10][R2.64] ;": an instruction, with its optional predicate guard
_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][A-Za-z0-9_.]*)")


def sass_opcodes(sass: str) -> dict[str, collections.Counter]:
    """Each function's instructions (full opcodes, "LDG.E.128") and how many of each, from `cuobjdump -sass`."""
    functions: dict[str, collections.Counter] = {}
    current = None
    for line in sass.splitlines():
        if match := _SASS_FUNCTION.match(line):
            current = functions.setdefault(match.group(1), collections.Counter())
        elif current is not None and (match := _SASS_INSTRUCTION.match(line)):
            current[match.group(1)] += 1
    return functions


def _load_bits(opcode: str) -> int:
    """A global load's width in bits from its modifiers (LDG.E.128, LDG.E.U8, LDG.E.LTC128B.64; none: 32)."""
    modifiers = set(opcode.split(".")[1:])
    for bits, names in ((128, {"128"}), (64, {"64"}), (16, {"U16", "S16"}), (8, {"U8", "S8"})):
        if modifiers & names:
            return bits
    return 32


def sass_counts(opcodes: collections.Counter) -> dict[str, int]:
    """SASS_COUNTS of a function's opcodes: an opcode counts under its base name (HMMA.16816.F32.BF16 as HMMA,
    FFMA.SAT as FFMA, LDL.LU.64 as LDL; HFMA2.MMA is not a tensor-core instruction), global loads by width."""
    counts = dict.fromkeys(SASS_COUNTS, 0)
    for opcode, n in opcodes.items():
        base = opcode.split(".")[0]
        key = f"LDG.{_load_bits(opcode)}" if base == "LDG" else base
        if key in counts:
            counts[key] += n
    return counts


def blocks_per_sm(threads: tuple[int, int, int], registers: int, shared_bytes: int, limits: SmLimits) -> int:
    """Blocks of a kernel one SM holds at once: the least of the limits by warps, registers (allocated per warp in
    register_unit units), shared memory (with the system's share of each block, in shared_unit units) and blocks.
    0: a block exceeds the SM (it cannot launch)."""
    block_threads = threads[0] * threads[1] * threads[2]
    warps = -(-block_threads // limits.warp_size)
    by_warps = limits.threads // limits.warp_size // warps
    warp_registers = -(-registers * limits.warp_size // limits.register_unit) * limits.register_unit
    by_registers = limits.registers // warp_registers // warps if warp_registers else limits.blocks
    if shared_bytes > limits.shared_per_block_optin:
        return 0
    block_shared = -(-(shared_bytes + limits.shared_reserved_per_block) // limits.shared_unit) * limits.shared_unit
    by_shared = limits.shared_bytes // block_shared
    return min(by_warps, by_registers, by_shared, limits.blocks)


def find_tool(name: str) -> str:
    """The path of CUDA's tool `name` (ptxas, cuobjdump): from NVIDIA's pip packages (`nvidia/*/bin/`), else PATH;
    MissingToolError naming the extra that installs it."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for path in sorted(Path(root).glob(f"*/bin/{name}")):
            if os.access(path, os.X_OK):
                return str(path)
    found = shutil.which(name)
    if found is None:
        raise MissingToolError(
            f"the GPU kernel report needs CUDA's {name} (NVIDIA's pip packages): pip install 'jaxpage[compile]'"
        )
    return found


def find_tools() -> dict[str, str]:
    """{name: path} of TOOLS (MissingToolError for the first missing)."""
    return {name: find_tool(name) for name in TOOLS}


def tool_version(path: str) -> str:
    """A tool's release line ("Cuda compilation tools, release 12.9, V12.9.86")."""
    output = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return next((line for line in output.splitlines() if "release" in line), output.strip())


_ASSEMBLED: dict[str, tuple[dict[str, PtxasInfo], dict[str, collections.Counter]]] = {}


def assemble(ptx: str, tools: dict[str, str]) -> tuple[dict[str, PtxasInfo], dict[str, collections.Counter]]:
    """(ptxas' figures, SASS opcodes) of each entry function of a PTX module, assembled for its target; kept by the
    PTX's digest, so that a kernel compiled alike in several programs is assembled once."""
    key = hashlib.sha256(f"{tools}\0{ptx}".encode()).hexdigest()
    if key not in _ASSEMBLED:
        with tempfile.TemporaryDirectory(prefix="jaxpage-ptxas-") as tmp:
            source, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
            source.write_text(ptx)
            command = [tools["ptxas"], f"-arch={ptx_arch(ptx)}", "-O3", "-v", str(source), "-o", str(cubin)]
            assembled = subprocess.run(command, capture_output=True, text=True)
            if assembled.returncode != 0:
                raise RuntimeError(f"ptxas failed ({assembled.returncode}): {assembled.stderr.strip()[:2000]}")
            dumped = subprocess.run([tools["cuobjdump"], "-sass", str(cubin)], capture_output=True, text=True)
            if dumped.returncode != 0:
                raise RuntimeError(f"cuobjdump failed ({dumped.returncode}): {dumped.stderr.strip()[:2000]}")
        _ASSEMBLED[key] = (ptxas_info(assembled.stdout + assembled.stderr), sass_opcodes(dumped.stdout))
    return _ASSEMBLED[key]


def read_dump(
    directory: str | os.PathLike, tools: dict[str, str], limits: SmLimits, prefix: str = KERNEL_PREFIX
) -> tuple[KernelReport, ...] | None:
    """The kernels whose names start with `prefix` in the XLA GPU dump `directory`, one report per distinct code and
    launch configuration, in launch order; None when the directory holds no thunk sequence (nothing was compiled
    into it: a program loaded from a cache). ValueError for a launch without PTX of that name."""
    directory = Path(directory)
    sequences = sorted(directory.glob("*.thunk_sequence.txt"))
    if not sequences:
        return None
    configs = collections.Counter(
        launch for path in sequences for launch in launches(path.read_text()) if launch.name.startswith(prefix)
    )
    codes: dict[str, list[tuple[str, tuple[int, int, int] | None]]] = collections.defaultdict(list)  # name -> PTX
    for path in sorted(directory.glob("*.ptx")):
        ptx = path.read_text()
        for entry in ptx_entries(ptx):
            if entry.startswith(prefix) and all(ptx != seen for seen, _ in codes[entry]):
                codes[entry].append((ptx, ptx_block(ptx, entry)))
    reports = []
    for launch, count in configs.items():
        variants = [ptx for ptx, block in codes.get(launch.name, []) if block in (None, launch.threads)]
        if not variants:
            raise ValueError(f"{directory}: a launch of {launch.name} {launch.threads} without its PTX")
        for ptx in variants:
            info, opcodes = assemble(ptx, tools)
            figures = info[launch.name]
            reports.append(
                KernelReport(
                    *(launch.name, count, launch.grid, launch.threads, launch.shared_bytes, figures.registers),
                    *(figures.stack_bytes, figures.spill_store_bytes, figures.spill_load_bytes),
                    blocks_per_sm(launch.threads, figures.registers, launch.shared_bytes, limits),
                    sass_counts(opcodes.get(launch.name, collections.Counter())),
                    ptx_arch(ptx),
                    codes=len(variants),
                )
            )
    return tuple(reports)
