"""The collectives of a compiled program, read from its HLO text, with the bytes each moves per chip.

`collectives(hlo_text)` finds every all-gather, reduce-scatter, all-reduce, all-to-all, ragged-all-to-all and
collective-permute (their synchronous form or the `-start` of their asynchronous one; a `-done` is not counted
again), sizes its operands from the instructions that define them, and counts what one chip of the
collective's group sends, as a ring or a pairwise exchange does over a group of n chips:

- all-gather: its operand to each of the n - 1 others (operand x (n - 1));
- reduce-scatter and all-to-all: the (n - 1) / n of its operand that other chips hold or need;
- all-reduce: a reduce-scatter and an all-gather (2 x operand x (n - 1) / n);
- ragged-all-to-all: (n - 1) / n of the smaller of its input and output buffers: how much is sent is known at
  run time only; a chip sends no more than its input holds and, with balanced routing, receives what it sends,
  no more than its output holds (a buffer sized for the worst case does not count), and the entries for its
  own chip stay;
- collective-permute: its operand, once.

The program is read as text: a collective inside a loop body counts once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")

# bytes per element of the HLO element types (sub-byte types packed)
_ELEMENT_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                  "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
                  "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
# `%name = SHAPE opcode(operands)...`: SHAPE is an array type or a parenthesized (nested) tuple of them
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\((.*)$")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,\s]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: its kind (one of KINDS), the instruction's name, the chips in its group,
    its operands' bytes on one chip, and the bytes one chip sends (the module docstring's model)."""

    kind: str
    name: str
    group_size: int
    operand_bytes: int
    sent_bytes: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def element_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (`bf16` -> 2, `f8e4m3fn` -> 1); 0 for one it does not know
    (a token, an opaque type)."""
    if dtype.startswith("f8"):
        return 1
    return _ELEMENT_BYTES.get(dtype, 0)


def shape_bytes(shape: str) -> int:
    """The bytes of an HLO shape: an array type (`bf16[1024,512]{1,0}`), or the sum over a tuple's arrays."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        total += element_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
    return math.ceil(total)


def _instruction(line: str) -> tuple[str, str, str, str] | None:
    """An HLO instruction line's name, shape, opcode and what follows the opcode's parenthesis."""
    head = _NAME.match(line)
    if head is None:
        return None
    text, end = line[head.end():], 0
    if text.startswith("("):
        depth = 0
        for end, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        end += 1
    else:
        end = len(text.split(" ", 1)[0])
    tail = _OPCODE.match(text[end:])
    if tail is None:
        return None
    return head.group(1), text[:end], tail.group(1), tail.group(2)


def _group_size(line: str, chips: int) -> int:
    if found := _IOTA_GROUPS.search(line):
        return int(found.group(2))
    if (found := _LIST_GROUPS.search(line)) and found.group(1).strip():
        return len(found.group(1).split(","))
    return chips  # no groups written: every chip of the program


def _operand_names(args: str) -> list[str]:
    """The instruction's operands: the `%name`s (or bare names) before the closing parenthesis of its call."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    names = []
    for part in re.sub(r"/\*.*?\*/", "", args[:end]).split(","):
        part = part.strip()
        if part:
            names.append(part.split()[-1].lstrip("%"))
    return names


def _sent(kind: str, operands: list[int], n: int) -> int:
    if n <= 1:
        return 0
    share = (n - 1) / n
    if kind == "all-gather":
        return sum(operands) * (n - 1)
    if kind == "all-reduce":
        return int(2 * sum(operands) * share)
    if kind == "ragged-all-to-all":
        return int(min(operands[:2]) * share) if operands else 0
    if kind == "collective-permute":
        return sum(operands)
    return int(sum(operands) * share)  # reduce-scatter, all-to-all


def collectives(hlo_text: str, chips: int) -> list[Collective]:
    """Every collective of a compiled program's HLO text (`compiled.as_text()`), in program order. `chips`:
    the program's devices, the group of a collective that names none."""
    shapes: dict[str, str] = {}
    found: list[tuple[str, str, str, str]] = []
    for line in hlo_text.splitlines():
        parsed = _instruction(line)
        if parsed is None:
            continue
        name, shape, opcode, rest = parsed
        shapes[name] = shape
        kind = opcode.removesuffix("-start")
        if kind in KINDS:
            found.append((kind, name, rest, line))
    result = []
    for kind, name, rest, line in found:
        names = _operand_names(rest)
        operands = [shape_bytes(shapes.get(n, "")) for n in names]
        n = 2 if kind == "collective-permute" else _group_size(line, chips)
        result.append(Collective(kind, name, n, sum(operands), _sent(kind, operands, n)))
    return result


def summary(found: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """kind -> {count, sent_bytes} over the collectives found, in KINDS order (kinds absent left out)."""
    totals: dict[str, dict[str, int]] = {}
    for c in found:
        entry = totals.setdefault(c.kind, {"count": 0, "sent_bytes": 0})
        entry["count"] += 1
        entry["sent_bytes"] += c.sent_bytes
    return {kind: totals[kind] for kind in KINDS if kind in totals}
