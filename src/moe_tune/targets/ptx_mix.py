"""The instruction mix of a kernel's inner loop, read from PTX text: a speed proxy that needs no GPU.

`loop_mixes(ptx)` splits the text into its kernels (`.entry NAME(`, its body the braces after the parameters)
and, in each, finds the loops: a label (`$L__BB0_2:`) and a later branch back to it (`@%p6
bra $L__BB0_2;`). The kernel's k loop is the loop with the most tensor-core instructions, then the most
instructions (an outer loop holds its inner ones: the outermost of a nest wins the tie). Triton's pipeliner
keeps one `block_k` step per iteration, so the loop's static counts (each instruction once, as written, not
as executed) are the mix of one k step. Counted there:

- tensor-core MMAs: `wgmma.mma_async` (sm_90) and `mma.sync` (sm_80);
- conversion instructions: `cvt` to or from a float or an 8- / 16-bit integer (`cvt.u64.u32` and the like
  widen addresses and are not counted), `prmt`, `lop3`, `shf`, `bfe`, `bfi` (type changes, byte permutes and
  bit fields: how packed or narrow weights are unpacked);
- float arithmetic outside the MMAs: `fma`, `mul`, `add`, `sub`, `neg`, `min`, `max` of a float type (`.f32`,
  `.bf16x2`, ...): scaling, the arithmetic of a conversion, or a dot done in scalar FMAs (`fma_f32`, apart);
- integer bit operations (`shr`, `shl`, `and`, `or`, `xor`, `not`): unpacking, but addressing too, so they are
  reported and left out of the conversion share;
- global loads by width: `ld.global` (`128b` for a `.v4.b32`) and `cp.async` by its copy size (`16B`), TMA
  bulk copies as `bulk`;
- shared memory: stores (`st.shared` by width, `128b` for a `.v4.b32`; `stmatrix`), loads (`ld.shared`,
  `ldmatrix`). A loop that stores to
  shared memory what it computed in registers makes a round trip (`round_trip`): on sm_90 the weights a
  `wgmma` reads from shared memory were converted in registers and written back first.

`dequant_share` is (conversion + float arithmetic but the float32 FMAs) over all instructions of the loop;
`fma_f32` stays apart, being either scaling or, where the loop has no MMA, the dot itself. Pure text in,
counts out.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)\s*\(", re.MULTILINE)
_LABEL = re.compile(r"^\s*(\$?L[\w$]*):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$?L[\w$]*)\s*$")
_GUARD = re.compile(r"^@!?%\w+\s+")
_FLOAT = re.compile(r"\.(?:f16|bf16|f32|f64)(?:x2)?\b|\.(?:f16|bf16)x2$")
_NARROW = re.compile(r"\.(?:f16|bf16|f32|f64|tf32|e4m3x2|e5m2x2|e2m1x2|[bsu](?:8|16))\b")
CONVERT = ("cvt", "prmt", "lop3", "shf", "bfe", "bfi")
FLOAT_MATH = ("fma", "mul", "add", "sub", "neg", "min", "max")
INT_BITS = ("shr", "shl", "and", "or", "xor", "not")


@dataclasses.dataclass
class LoopMix:
    """The counts of one kernel's k loop (see the module docstring); `loop_found` False: the kernel has no
    loop, and the counts are of its whole body."""

    kernel: str
    loop_found: bool
    instructions: int = 0
    wgmma: int = 0
    mma_sync: int = 0
    convert: dict[str, int] = dataclasses.field(default_factory=dict)
    float_math: dict[str, int] = dataclasses.field(default_factory=dict)
    fma_f32: int = 0
    int_bits: int = 0
    global_loads: dict[str, int] = dataclasses.field(default_factory=dict)
    shared_stores: int = 0
    shared_store_widths: dict[str, int] = dataclasses.field(default_factory=dict)
    shared_loads: int = 0

    @property
    def tensor_core(self) -> int:
        return self.wgmma + self.mma_sync

    @property
    def dequant_share(self) -> float:
        done = sum(self.convert.values()) + sum(self.float_math.values()) - self.fma_f32
        return done / self.instructions if self.instructions else 0.0

    @property
    def round_trip(self) -> bool:
        return self.shared_stores > 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tensor_core": self.tensor_core,
                "dequant_share": round(self.dequant_share, 4), "round_trip": self.round_trip}


def _kernels(ptx: str) -> dict[str, list[str]]:
    """Kernel name -> the lines of its body: from the `{` after its parameters to the `}` that closes it
    (braces counted: register lists and inline assembly scopes open and close their own)."""
    found = {}
    for match in _ENTRY.finditer(ptx):
        start = ptx.find("{", ptx.find(")", match.end()))
        depth, end = 0, len(ptx)
        for i in range(max(start, 0), len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                end = i
                break
        found[match.group(1)] = ptx[start + 1:end].splitlines() if start >= 0 else []
    return found


def _statements(line: str) -> list[str]:
    """The instructions of one line (inline assembly puts several on a line), without guards, braces,
    comments and declarations."""
    out = []
    for part in line.split("//")[0].split(";"):
        part = part.strip().strip("{}").strip()
        part = _GUARD.sub("", part)
        if part and not part.startswith(".") and not _LABEL.match(part + ":" if part.endswith(":") else part):
            out.append(part)
    return out


def _loops(lines: list[str]) -> list[tuple[int, int]]:
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = []
    for i, line in enumerate(lines):
        for statement in line.split(";"):
            found = _BRANCH.search(statement.strip())
            if found and labels.get(found.group(1), i + 1) < i:
                spans.append((labels[found.group(1)], i))
    return spans


def _width(statement: str, opcode: str) -> str | None:
    """The width key of a global load: `ld.global` bits, `cp.async` copy bytes, `bulk` for TMA; None else."""
    if opcode.startswith("cp.async.bulk"):
        return "bulk"
    if opcode.startswith("cp.async.") and ".global" in opcode:
        size = statement.split(",")[2].strip() if statement.count(",") >= 2 else ""
        try:
            return f"cp.async.{int(size, 0)}B"
        except ValueError:
            return "cp.async"
    if opcode.startswith("ld.global"):
        return f"ld.global.{_bits(opcode)}b"
    return None


def _bits(opcode: str) -> int:
    """The bits one load or store moves: its vector count times its type's width (`.v4.b32`: 128)."""
    parts = opcode.split(".")
    vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    return vector * next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 0)


def mix_of(kernel: str, lines: list[str], loop_found: bool) -> LoopMix:
    mix = LoopMix(kernel, loop_found)
    convert, math, loads, stores = (collections.Counter() for _ in range(4))
    for line in lines:
        for statement in _statements(line):
            opcode = statement.split()[0]
            base = opcode.split(".")[0]
            mix.instructions += 1
            if opcode.startswith("wgmma.mma_async"):
                mix.wgmma += 1
            elif opcode.startswith("mma.sync"):
                mix.mma_sync += 1
            elif base in CONVERT and (base != "cvt" or _NARROW.search(opcode)):
                convert[base] += 1
            elif base in FLOAT_MATH and _FLOAT.search(opcode):
                math[opcode] += 1
                mix.fma_f32 += opcode.startswith("fma") and ".f32" in opcode
            elif base in INT_BITS:
                mix.int_bits += 1
            elif opcode.startswith(("st.shared", "stmatrix")):
                mix.shared_stores += 1
                stores["stmatrix" if base == "stmatrix" else f"{_bits(opcode)}b"] += 1
            elif opcode.startswith(("ld.shared", "ldmatrix")):
                mix.shared_loads += 1
            elif (width := _width(statement, opcode)) is not None:
                loads[width] += 1
    mix.convert, mix.float_math, mix.global_loads = dict(convert), dict(math), dict(loads)
    mix.shared_store_widths = dict(stores)
    return mix


def loop_mixes(ptx: str) -> dict[str, LoopMix]:
    """Kernel name -> the mix of its k loop (its whole body where it has no loop)."""
    out = {}
    for name, lines in _kernels(ptx).items():
        spans = _loops(lines)
        if not spans:
            out[name] = mix_of(name, lines, False)
            continue
        mixes = [mix_of(name, lines[a:b + 1], True) for a, b in spans]
        out[name] = max(mixes, key=lambda m: (m.tensor_core, m.instructions))
    return out
