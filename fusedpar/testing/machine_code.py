"""Reading a kernel's machine code without a GPU: ptxas's notes and the SASS hot loop.

What decides a Triton kernel's speed on an H100 shows in what the compiler emits for it:

| reading        | source                 | what it tells                                        |
| -------------- | ---------------------- | ---------------------------------------------------- |
| ptxas notes    | ``ptxas -v``'s log     | ``C7515``, ``C7511``...: ptxas serialized the wgmma  |
|                |                        | (a wait after every HGMMA), spills, registers        |
| hot loop       | ``cuobjdump -sass``    | per iteration of the innermost loop with the most    |
|                |                        | tensor-core instructions: HGMMA count and shapes,    |
|                |                        | wgmma waits, loads by kind, instructions, local      |
|                |                        | memory (spill) traffic                               |

The hot loop is found from the branches: a branch to an earlier address closes a loop
over ``[target, branch]``; an innermost loop contains no other. Inside it, code under a
per-iteration branch (a masked block's extra work) runs on some iterations only, so the
loop reports two paths through its body, from the head to the back edge: the shortest
(``insts_min``: the fast path, e.g. an unmasked attention block) and the longest
(``insts_max``). Counts other than instructions are taken along the shortest path.
"""

import re
from dataclasses import dataclass

_NOTE = re.compile(r"\((C\d{4})\)\s*(.*)")


def ptxas_notes(log: str) -> list[str]:
    """The coded notes (``"C7515"``...) in a ``ptxas -v`` log, in order, without repeats."""
    codes = []
    for line in log.splitlines():
        match = _NOTE.search(line)
        if match and match.group(1) not in codes:
            codes.append(match.group(1))
    return codes


def wgmma_serialized(log: str) -> bool:
    """Whether ptxas serialized the warpgroup MMAs: a wait after every wgmma instead of
    letting them run asynchronously. Its notes name several causes, each with its own
    code (C7515: non-wgmma instructions define an accumulator mid-pipeline; C7511: too
    few registers for the pipeline), all with this wording."""
    return any(
        "wgmma" in m.group(2) and "serialized" in m.group(2)
        for m in map(_NOTE.search, log.splitlines())
        if m
    )


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "" when unconditional, else e.g. "@!P2"
    opcode: str  # with its modifiers: "HGMMA.64x64x16.F32.BF16"
    operands: str

    @property
    def target(self) -> int | None:
        """The address a branch goes to (None for anything else)."""
        if self.opcode.split(".")[0] != "BRA":
            return None
        match = re.search(r"0x([0-9a-f]+)", self.operands)
        return int(match.group(1), 16) if match else None


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")


def parse_sass(text: str) -> list[Instruction]:
    """The instructions of a ``cuobjdump -sass`` listing (one kernel), in address order."""
    out = []
    for line in text.splitlines():
        match = _LINE.search(line)
        if match:
            address, predicate, opcode, operands = match.groups()
            out.append(
                Instruction(int(address, 16), (predicate or "").strip(), opcode, operands.strip())
            )
    return out


def _is_mma(inst: Instruction) -> bool:
    return inst.opcode.startswith(("HGMMA", "HMMA"))


def _loops(insts: list[Instruction]) -> list[tuple[int, int]]:
    """Innermost loops as (first index, back-edge index)."""
    index = {inst.address: i for i, inst in enumerate(insts)}
    loops = [
        (index[inst.target], i)
        for i, inst in enumerate(insts)
        if inst.target is not None and inst.target <= inst.address and inst.target in index
    ]
    return [
        (a, b)
        for a, b in loops
        if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)
    ]


def _paths(insts: list[Instruction], head: int, back: int) -> tuple[list[int], int]:
    """The shortest path through a loop body, from `head` to the back edge `back` (as
    instruction indices), and the longest path's length. Branches inside an innermost
    loop go forward; a branch out of the body ends that path (it leaves the loop)."""
    index = {inst.address: i for i, inst in enumerate(insts)}
    best: dict[int, tuple[int, int, list[int] | None]] = {}  # i -> (min, max, min path)
    for i in range(back, head - 1, -1):
        inst = insts[i]
        if i == back:
            best[i] = (1, 1, [i])
            continue
        successors = []
        target = inst.target
        if target is not None and head <= index.get(target, -1) <= back:
            successors.append(index[target])
        falls_through = not _always_leaves(inst)
        if falls_through and i + 1 <= back:
            successors.append(i + 1)
        reachable = [best[s] for s in successors if best.get(s, (0, 0, None))[2] is not None]
        if not reachable:
            best[i] = (0, 0, None)
            continue
        shortest = min(reachable, key=lambda r: r[0])
        best[i] = (shortest[0] + 1, max(r[1] for r in reachable) + 1, [i, *shortest[2]])
    _, longest, path = best[head]
    return path or [], longest


def _always_leaves(inst: Instruction) -> bool:
    """An unconditional jump, exit or return: no predicate on the instruction, none among
    its operands (``BRA P4, 0x3dd0`` branches on P4) and no divergence test
    (``BRA.DIV`` jumps only when the warp has diverged)."""
    if inst.predicate or inst.opcode == "BRA.DIV":
        return False
    if inst.opcode.split(".")[0] not in ("BRA", "EXIT", "RET"):
        return False
    return not re.match(r"!?U?P\d", inst.operands)


def hot_loop(insts: list[Instruction]) -> dict | None:
    """Statistics of one iteration of the innermost loop with the most tensor-core
    instructions (ties: the fewest instructions), or None when no loop has any.

    ``hgmma`` {shape: count} (``HMMA`` on sm_80), ``wgmma_waits`` (``WARPGROUP.DEPBAR``),
    ``loads`` {``tma``: UTMALDG, ``cp_async``: LDGSTS, ``global``: LDG},
    ``tma_reduces`` (UTMAREDG: a tile added into global memory by TMA), ``local``
    (LDL/STL: spill traffic), ``insts_min``/``insts_max`` (the shortest and longest path
    through the body), ``int64`` (64-bit integer adds and wide multiplies: address
    arithmetic), all along the shortest path but the last two."""
    best = None
    for head, back in _loops(insts):
        path, longest = _paths(insts, head, back)
        body = [insts[i] for i in path]
        mma = sum(map(_is_mma, body))
        if mma and (best is None or (mma, -len(body)) > (best[0], -len(best[1]))):
            best = (mma, body, longest)
    if best is None:
        return None
    _, body, longest = best
    shapes: dict[str, int] = {}
    for inst in body:
        if _is_mma(inst):
            shape = inst.opcode.split(".")[1]
            shapes[shape] = shapes.get(shape, 0) + 1
    ops = [inst.opcode for inst in body]
    return {
        "hgmma": dict(sorted(shapes.items())),
        "wgmma_waits": sum(op.startswith("WARPGROUP.DEPBAR") for op in ops),
        "loads": {
            "tma": sum(op.startswith("UTMALDG") for op in ops),
            "cp_async": sum(op.startswith("LDGSTS") for op in ops),
            "global": sum(op.split(".")[0] == "LDG" for op in ops),
        },
        "tma_reduces": sum(op.startswith("UTMAREDG") for op in ops),
        "local": sum(op.split(".")[0] in ("LDL", "STL") for op in ops),
        "int64": sum(_is_int64(inst) for inst in body),
        "insts_min": len(body),
        "insts_max": longest,
    }


def _is_int64(inst: Instruction) -> bool:
    """64-bit integer address arithmetic: a wide multiply-add, or the high half of a
    carried add (``IADD3.X`` / ``IMAD.X``; its low half is counted by the ``.X``)."""
    return inst.opcode.startswith(("IMAD.WIDE", "IADD3.X", "IMAD.X", "LEA.HI.X"))
