"""The kernels compile for AMD MI300X (gfx942) and MI355X (gfx950) on any machine, under AMD's memory rules.

Triton's wheel carries AMD's linker and device libraries, so ``triton.compile`` makes a code object for
``GPUTarget("hip", "gfx942", 64)`` without a GPU. Every launch shape the sm_90 test compiles
(``test_gpu_compile.SHAPES``) is compiled for each target, in a process of its own per target (LLVM
aborts the whole process on code it cannot lower: the first fused call on a ROCm machine would have
taken the user's process down), both targets at once. The AMD assembly is then checked as the sm_90
test checks PTX (docs/architecture.md, "Memory order"):

- every loop that waits for a peer (one that reads the timer, ``s_memrealtime``, itself or in a loop
  nested in it) loads on each iteration through vector loads that bypass the caches (``sc0 sc1``),
  never a scalar ``s_load`` (a poll of a uniform address became one, hoisted out of the loop: a hang),
  and no such loop waits without loading: checked on the natural loops of the control-flow graph and
  on LLVM's own loop annotations in the assembly (a loop that only redoes the block-wide reduction and
  reads the timer would spin on a value it never reads again); a kernel has a reading wait for each
  peer's descriptor and rows. A plain volatile poll, compiled beside them, must fail these checks;
- the words peers wait for are written through (stores with ``sc0 sc1``), and the end-of-call arrival
  is a system-scope release (``buffer_wbl2 sc0 sc1``) before its atomic and an acquire
  (``buffer_inv sc0 sc1``) after it; every other atomic has its release and acquire too;
- rows still move 16 bytes an access: the only 16-bit accesses are the call descriptor's, as on sm_90.
"""

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_gpu_compile import SHAPES, compile_shape  # noqa: E402

TARGETS = ("gfx942", "gfx950")
_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_BRANCH = re.compile(r"^\s*s_(?:c)?branch\w*\s+(\.LBB\d+_\d+)")
_VECTOR_LOAD = re.compile(r"^\s*(?:global|buffer|flat)_load_\w+")
_BYPASS = re.compile(r"\bsc0 sc1\b")
_STORE = re.compile(r"^\s*(?:global|buffer|flat)_store_\w+")
_ATOMIC = re.compile(r"^\s*(?:global|buffer|flat)_atomic_\w+")
_NARROW = re.compile(r"^\s*(?:global|buffer|flat)_"
                     r"(?:load_ushort|load_sshort|load_short_d16\w*|store_short\w*)\b")


def _instructions(asm: str) -> list[str]:
    """The assembly's lines without comments, directives or blank lines (labels kept)."""
    out = []
    for line in asm.splitlines():
        line = line.split(";")[0].rstrip()
        if line.strip() and not line.lstrip().startswith("."):
            out.append(line)
        elif _LABEL.match(line):
            out.append(line)
    return out


def _blocks(lines: list[str]) -> tuple[list[list[str]], list[set[int]]]:
    """The basic blocks of the assembly and each one's successors."""
    blocks, current = [], []
    for line in lines:
        if _LABEL.match(line) and current:
            blocks.append(current)
            current = []
        current.append(line)
        if re.match(r"^\s*s_(?:c?branch\w*|endpgm)\b", line):
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    where = {m.group(1): i for i, block in enumerate(blocks) if (m := _LABEL.match(block[0]))}
    successors = []
    for i, block in enumerate(blocks):
        last = block[-1].strip()
        nexts = set()
        if m := _BRANCH.match(block[-1]):
            nexts.add(where[m.group(1)])
        if not (last.startswith("s_branch ") or last.startswith("s_endpgm")) and i + 1 < len(blocks):
            nexts.add(i + 1)
        successors.append(nexts)
    return blocks, successors


def _predecessors(successors: list[set[int]]) -> list[set[int]]:
    preds = [set() for _ in successors]
    for u, nexts in enumerate(successors):
        for v in nexts:
            preds[v].add(u)
    return preds


def _dominators(successors: list[set[int]]) -> list[set[int]]:
    """For each block, the blocks every path from the entry to it passes through."""
    n, preds = len(successors), _predecessors(successors)
    dom = [{0}] + [set(range(n)) for _ in range(n - 1)]
    changed = True
    while changed:
        changed = False
        for v in range(1, n):
            new = {v} | (set.intersection(*(dom[u] for u in preds[v])) if preds[v] else set())
            if new != dom[v]:
                dom[v], changed = new, True
    return dom


def _natural_loops(successors: list[set[int]]) -> list[set[int]]:
    """The blocks of every natural loop (the back edges to one header together). Found from the
    control-flow graph, not the layout: AMD's structurizer places a loop's blocks apart."""
    dom, preds = _dominators(successors), _predecessors(successors)
    loops: dict[int, set[int]] = {}
    for u, nexts in enumerate(successors):
        for h in nexts:
            if h in dom[u]:  # a back edge u -> h
                body, stack = loops.setdefault(h, {h}), [u]
                while stack:
                    v = stack.pop()
                    if v not in body:
                        body.add(v)
                        stack.extend(preds[v])
    return list(loops.values())


def _on_a_cycle(start: int, successors: list[set[int]]) -> bool:
    seen, stack = set(), list(successors[start])
    while stack:
        v = stack.pop()
        if v == start:
            return True
        if v not in seen:
            seen.add(v)
            stack.extend(successors[v])
    return False


_BLOCK_START = re.compile(r"^\.LBB(\d+_\d+):|^; %bb\.(\d+):")
_HEADER = re.compile(r"=>\s*This (?:Inner )?Loop Header: Depth=(\d+)")
_MEMBER = re.compile(r"in Loop: Header=BB(\d+_\d+) Depth=(\d+)")
_PARENT = re.compile(r"Parent Loop BB(\d+_\d+) Depth=(\d+)")


def annotated_loops(asm: str) -> dict[str, dict]:
    """LLVM's own loops, from the comments it writes on each block of a loop (``=>This Loop Header``,
    ``in Loop: Header=BB0_5``, ``Parent Loop BB0_3``): ``{header: {"parent": header or None, "lines":
    the instructions of the blocks whose innermost loop it is}}``. Independent of how the test reads the
    control-flow graph, and blind to the layout (a loop's blocks may lie apart)."""
    loops: dict[str, dict] = {}
    innermost = None  # the loop the current block belongs to, innermost first
    for line in asm.splitlines():
        comment = line.split(";", 1)[1] if ";" in line else ""
        start = _BLOCK_START.match(line)
        if start:
            innermost = None
            label = start.group(1)
        if (m := _MEMBER.search(comment)) and (start or innermost is None):
            innermost = m.group(1)
            loops.setdefault(innermost, {"parent": None, "lines": []})
        elif m := _PARENT.search(comment):
            loops.setdefault(label, {"parent": None, "lines": []})["parent"] = m.group(1)
        elif _HEADER.search(comment):
            innermost = label
            loops.setdefault(innermost, {"parent": None, "lines": []})
        if innermost is not None and not start and line.strip() and not line.lstrip().startswith((";", ".")):
            loops[innermost]["lines"].append(line.split(";")[0].rstrip())
    return loops


def loops_waiting_without_reading(asm: str) -> list[str]:
    """Every loop of LLVM's that reads the timer (in its own blocks or a loop nested in it) but loads
    nothing past the caches through the vector path: a wait that may spin on a value it never reads
    again until its deadline."""
    loops = annotated_loops(asm)
    children: dict[str, list[str]] = {}
    for header, loop in loops.items():
        if loop["parent"] is not None:
            children.setdefault(loop["parent"], []).append(header)

    def body(header: str) -> list[str]:
        return loops[header]["lines"] + [line for child in children.get(header, []) for line in body(child)]

    found = []
    for header in loops:
        lines = body(header)
        timer = any("s_memrealtime" in line for line in lines)
        polls = [line for line in lines if _VECTOR_LOAD.match(line) and _BYPASS.search(line)]
        if timer and not polls:
            found.append(f"the loop at BB{header} reads the timer and polls no memory")
    return found


def check_amdgcn(asm: str) -> dict:
    """What the checks above need from one kernel's assembly: counts and the problems found."""
    lines = _instructions(asm)
    problems = []
    blocks, successors = _blocks(lines)
    reading = 0
    problems += loops_waiting_without_reading(asm)
    timer = {i for i, block in enumerate(blocks) if any("s_memrealtime" in line for line in block)}
    waits = [loop for loop in _natural_loops(successors) if loop & timer]
    for loop in waits:
        if any(other < loop for other in waits):
            continue  # not innermost: the loop of rows around waits
        body = [line for i in sorted(loop) for line in blocks[i]]
        where = blocks[min(loop)][0].strip()
        loads = [line.strip() for line in body if _VECTOR_LOAD.match(line)]
        if not loads:
            problems.append(f"the wait loop at {where} reads the timer and loads nothing")
            continue
        reading += 1
        problems += [f"the wait loop at {where} loads through the caches: {load}"
                     for load in loads if not _BYPASS.search(load)]
        problems += [f"the wait loop at {where} polls with a scalar load: {line.strip()}"
                     for line in body if line.lstrip().startswith("s_load")]
    # A timer read on a cycle that no natural loop holds (irreducible control flow) would go unchecked.
    in_loops = set().union(*waits) if waits else set()
    problems += [f"a timer read on a cycle that is no natural loop: {blocks[i][0].strip()}"
                 for i in sorted(timer - in_loops) if _on_a_cycle(i, successors)]
    for i, line in enumerate(lines):
        if not _ATOMIC.match(line):
            continue
        before, after = lines[max(0, i - 4):i], lines[i + 1:i + 5]
        release = [x.strip() for x in before if x.lstrip().startswith("buffer_wbl2")]
        acquire = [x.strip() for x in after if x.lstrip().startswith("buffer_inv")]
        if not release or not acquire:
            problems.append(f"an atomic without release before and acquire after: {line.strip()}")
        elif "atomic_add" in line and not (_BYPASS.search(release[-1]) and _BYPASS.search(acquire[0])
                                          and _BYPASS.search(line)):
            problems.append(f"the arrival is not a system-scope release and acquire: {release[-1]}; "
                            f"{line.strip()}; {acquire[0]}")
    if not any("atomic_add" in line for line in lines if _ATOMIC.match(line)):
        problems.append("no arrival atomic")
    written_through = sum(1 for line in lines if _STORE.match(line) and _BYPASS.search(line))
    return {"wait_loops": reading, "written_through": written_through,
            "narrow": sum(1 for line in lines if _NARROW.match(line)),
            "wide": sum(1 for line in lines
                        if re.match(r"^\s*(?:global|buffer)_(?:load|store)_dwordx4", line)),
            "problems": problems}


def _poll_kernels():
    """Two waits for a flag, as a plain volatile load and as ``vendor.load_polled``: the checks must
    tell them apart (on AMD the first is one scalar load hoisted out of the loop, a hang)."""
    import triton
    import triton.language as tl

    from tpfuse.kernels.vendor import load_polled, now

    @triton.jit
    def _volatile_poll_kernel(flag_ptr, deadline):
        seen = tl.load(flag_ptr, volatile=True)
        while (seen == 0) & (now() < deadline):
            seen = tl.load(flag_ptr, volatile=True)
        tl.store(flag_ptr + 1, seen)

    @triton.jit
    def _vendor_poll_kernel(flag_ptr, deadline):
        one = tl.arange(0, 1)
        seen = tl.max(load_polled(flag_ptr + one, one < 1), axis=0)
        while (seen == 0) & (now() < deadline):
            seen = tl.max(load_polled(flag_ptr + one, one < 1), axis=0)
        tl.store(flag_ptr + 1, seen)

    return {"volatile": _volatile_poll_kernel, "load_polled": _vendor_poll_kernel}


def _compile_for(arch: str) -> None:
    """Compile every shape for ``arch`` and print one JSON line per shape (run as a script)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("hip", arch, 64)
    for poll, kernel in _poll_kernels().items():
        compiled = triton.compile(ASTSource(kernel, {"flag_ptr": "*i32", "deadline": "i64"}, {}),
                                  target=target,
                                  options={"num_warps": 1})
        print(json.dumps(dict(check_amdgcn(compiled.asm["amdgcn"]), poll=poll)), flush=True)
    for name, world, dtype, constexprs in SHAPES:
        compiled, flags = compile_shape(name, world, dtype, constexprs, target, False, 16)
        report = check_amdgcn(compiled.asm["amdgcn"])
        print(json.dumps(dict(report, kernel=name, world=world, dtype=dtype, shape=repr(constexprs),
                              wire=bool(flags.get("WIRE")), hsaco=len(compiled.asm["hsaco"]))), flush=True)


@pytest.fixture(scope="module")
def compiles():
    """Both targets' compilations, started at once (each in its own process, without TRITON_INTERPRET)."""
    import triton

    if not os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends", "amd")):
        pytest.skip("this Triton has no AMD backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {arch: subprocess.Popen([sys.executable, __file__, arch], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for arch in TARGETS}
    yield {arch: proc.communicate(timeout=900) + (proc.returncode,) for arch, proc in procs.items()}


@pytest.mark.parametrize("arch", TARGETS)
def test_kernels_compile_for_amd_under_its_memory_rules(compiles, arch):
    out, err, code = compiles[arch]
    assert code == 0, f"compiling for {arch} failed (exit {code}):\n{out}\n{err[-3000:]}"
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    polls = {r.pop("poll"): r for r in reports if "poll" in r}
    reports = [r for r in reports if "kernel" in r]
    assert len(reports) == len(SHAPES), out
    # The checks see the bug they are for: a volatile poll fails them, load_polled passes.
    waits = [p for p in polls["volatile"]["problems"] if "wait loop" in p]
    assert waits, polls["volatile"]
    assert not [p for p in polls["load_polled"]["problems"] if "wait loop" in p], polls["load_polled"]
    bad = []
    for r in reports:
        what = f"{r['kernel']} W={r['world']} {r['dtype']} {r['shape']}"
        bad += [f"{what}: {p}" for p in r["problems"]]
        peers = r["world"] - 1
        if r["wait_loops"] < 2 * peers:  # each peer's descriptor, and its rows
            bad.append(f"{what}: {r['wait_loops']} wait loops that read memory, "
                       f"expected at least {2 * peers}")
        if r["written_through"] < 2:  # pushes to peers, clears of our own slot
            bad.append(f"{what}: {r['written_through']} written-through stores")
        # Rows move 16 bytes an access; the descriptor's 8 words (a thread a word) do not: its send,
        # its two polls and its clear, per peer, as on sm_90. The fp8 wire's exponent words add a few.
        allowed = 4 * peers + (4 * r["world"] if r["wire"] else 0)
        if r["narrow"] > allowed or r["wide"] == 0:
            bad.append(f"{what}: {r['narrow']} 16-bit accesses (at most {allowed}), {r['wide']} of 16 bytes")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    _compile_for(sys.argv[1])
