"""Every memory address a kernel's PTX computes, by running its threads one at a time on the CPU.

For kernels that cannot run here (no GPU) but whose failures are about addresses: a misaligned
cp.async or ldmatrix, a vector store wider than its address's alignment, a load past a buffer. The
interpreter executes the integer arithmetic exactly (as PTX defines it, at each instruction's width)
and records each memory access's space, address and size; it does not model memory contents beyond
what the caller supplies for global loads (block tables, lengths), so the values loaded from shared
memory, and everything computed from them, are stand-ins:

- ldmatrix results are 0 and mma.sync results a fixed 0.5; float instructions are evaluated in Python
  floats, so a branch on a float (a lazy rescale) goes one way or the other, never both; of the float
  conversions only the packing of two f32 into bf16x2 / f16x2 (round to nearest even) is computed,
  the others give 0 (they feed MMA operands);
- shfl.sync returns the thread's own value: right for the warp-uniform values kernels broadcast (the
  shared base, the warp index), a stand-in for butterfly reductions of floats;
- barriers (CTA and cluster), fences and cp.async groups are no-ops (one thread runs at a time);
- distributed shared memory: `mapa` puts the peer's rank in bits 24 and up of the shared address
  (CLUSTER_RANK_SHIFT; a CTA's shared window is far smaller), and a `ld.shared::cluster` is recorded
  (space "cluster") and reads 0: the caller decodes the rank and offset of each;
- shared memory holds what earlier stores (of this thread, or of earlier threads of the CTA when the
  caller passes one `shared_memory` dict to each) left there, 0 elsewhere: so a flag one thread
  stores before a barrier reaches the threads run after it;
- a global atomic returns the value the caller supplies at its address (0 by default) and changes
  nothing, so the caller chooses which branch of a counter test a CTA takes.

So it answers "which addresses does thread t of CTA c touch", for kernels whose addresses depend on
indices, shapes, strides and global integer loads, not on computed floats. It knows the instructions
the decode kernel (fa4_jax/kernels/sm90/decode.py) compiles to, and raises NotImplementedError on any
other, so a kernel change that needs more says so rather than being skipped.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct

_MASKS = {width: (1 << width) - 1 for width in (8, 16, 32, 64)}
CLUSTER_RANK_SHIFT = 24
_COMPARISONS = {"lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
                "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
                "lo": lambda a, b: a < b, "ls": lambda a, b: a <= b, "hi": lambda a, b: a > b,
                "hs": lambda a, b: a >= b}


@dataclasses.dataclass(frozen=True)
class Access:
    kind: str       # the instruction: cp.async.dst, cp.async.src, ldmatrix, ld.global, st.global
    space: str      # shared or global
    address: int
    size: int       # bytes
    values: tuple = ()   # a store's source values (their bits, one per register)


@dataclasses.dataclass
class Program:
    statements: list
    labels: dict
    params: list    # (name, bytes) in declaration order


def parse(ptx: str) -> Program:
    """The statements of the (one) .entry in `ptx`, its labels and its parameters."""
    entry = ptx.index(".entry")
    params = [(name, int(size)) for name, size in
              re.findall(r"\.param \.align \d+ \.b8 (\w+)\[(\d+)\]", ptx[entry:ptx.index("{", entry)])]
    lines = []
    for line in ptx[ptx.index("{", entry) + 1:].splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".loc", ".file", ".reg", ".pragma", "$L__tmp")):
            lines.append(line)
    statements, labels = [], {}
    for piece in " ".join(lines).split(";"):
        piece = piece.strip()
        while (label := re.match(r"^(\$L__\w+):\s*(.*)$", piece)) is not None:
            labels[label.group(1)] = len(statements)
            piece = label.group(2).strip()
        if piece and piece != "}":
            statements.append(piece)
    return Program(statements, labels, params)


def _width(type_name: str) -> int:
    if type_name in ("pred",):
        return 1
    if type_name in ("f32", "f16x2"):
        return 32
    return int(re.sub(r"\D", "", type_name))


def _signed(value: int, width: int) -> int:
    value &= _MASKS[width]
    return value - (1 << width) if value >> (width - 1) else value


def _float_bits(value: float) -> int:
    if value != value:
        return 0x7FC00000
    if math.isinf(value) or abs(value) > 3.4e38:
        return 0x7F800000 if value > 0 else 0xFF800000
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _half_bits(value: float, kind: str) -> int:
    """The 16 bits of `value` rounded to nearest even as bf16 (kind bf16x2) or fp16 (f16x2)."""
    if kind == "f16x2":
        try:
            return struct.unpack("<H", struct.pack("<e", value))[0]
        except OverflowError:
            return 0x7C00 if value > 0 else 0xFC00
    bits = _float_bits(value)
    if bits & 0x7FFFFFFF > 0x7F800000:
        return 0x7FC0
    return ((bits + 0x7FFF + (bits >> 16 & 1)) >> 16) & 0xFFFF


def half_float(bits: int, kind: str) -> float:
    """The float of 16 bits of bf16 (kind bf16x2) or fp16 (f16x2)."""
    if kind == "f16x2":
        return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]
    return _bits_float((bits & 0xFFFF) << 16)


class _Thread:
    def __init__(self, program: Program, thread: int, block: tuple, params: dict, global_memory: dict,
                 shared_base: int, shared_memory: dict):
        self.program = program
        self.registers = {"%tid.x": thread, "%tid.y": 0, "%tid.z": 0, "%ctaid.x": block[0],
                          "%ctaid.y": block[1], "%ctaid.z": block[2]}
        self.params, self.global_memory, self.shared_base = params, global_memory, shared_base
        self.shared_memory = shared_memory
        self.accesses = []

    def value(self, operand: str, width: int = 64) -> int:
        if operand.startswith("%"):
            return self.registers.get(operand, 0)
        if operand.startswith("0f"):
            return int(operand[2:], 16)
        if operand.startswith("__dynamic_shmem"):
            return self.shared_base
        return int(operand, 0) & _MASKS[width]

    def address(self, operand: str) -> tuple:
        match = re.match(r"^\[([%\w.]+)(?:\+(-?\d+))?\]$", operand.strip())
        return match.group(1), int(match.group(2) or 0)

    def write(self, register: str, value: int, width: int):
        self.registers[register] = value & _MASKS[max(width, 32) if width < 64 else 64]

    def run(self, max_steps: int):
        pc, steps = 0, 0
        statements, labels = self.program.statements, self.program.labels
        while pc < len(statements):
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"more than {max_steps} instructions: a loop that does not end?")
            statement = statements[pc]
            pc += 1
            guard = re.match(r"^@(!?)(%p\d+)\s+(.*)$", statement)
            if guard:
                taken = bool(self.registers.get(guard.group(2), 0)) != bool(guard.group(1))
                if not taken:
                    continue
                statement = guard.group(3)
            opcode, _, rest = statement.partition(" ")
            operands = [x.strip() for x in re.split(r",(?![^{]*})", rest)] if rest else []
            if opcode == "ret":
                return
            if opcode.startswith("bra"):
                pc = labels[operands[0]]
                continue
            self.execute(opcode, operands)

    def record(self, kind: str, space: str, base_offset: tuple, size: int):
        base, offset = base_offset
        self.accesses.append(Access(kind, space, self.value(base) + offset, size))

    def execute(self, opcode: str, operands: list):
        parts = opcode.split(".")
        name, type_name = parts[0], parts[-1]
        if name in ("bar", "barrier", "fence", "membar") or opcode.startswith(("cp.async.commit_group",
                                                                      "cp.async.wait_group")):
            return
        if name == "atom" and parts[1] == "global":
            base, offset = self.address(operands[1])
            address = self.value(base) + offset
            self.accesses.append(Access("atom.global", "global", address, _width(type_name) // 8))
            self.registers[operands[0]] = self.global_memory.get(address, 0)
            return
        if opcode.startswith("cp.async.cg.shared.global") or opcode.startswith("cp.async.ca.shared.global"):
            size = int(operands[2])
            self.record("cp.async.dst", "shared", self.address(operands[0]), size)
            self.record("cp.async.src", "global", self.address(operands[1]), size)
            return
        if name == "mapa":
            rank = self.value(operands[2], 32)
            self.write(operands[0], self.value(operands[1], 32) | rank << CLUSTER_RANK_SHIFT, 32)
            return
        if name == "ldmatrix":
            self.record("ldmatrix", "shared", self.address(operands[1]), 16)
            for register in operands[0].strip("{}").split(","):
                self.registers[register.strip()] = 0
            return
        if name == "mma":
            for register in operands[0].strip("{}").split(","):
                self.registers[register.strip()] = _float_bits(0.5)
            return
        if name in ("ld", "st"):
            self.load_store(name, parts[1], type_name, operands)
            return
        if name == "shfl":
            self.write(operands[0], self.value(operands[1]), 32)
            return
        if name in ("and", "or", "xor", "not") and type_name == "pred":
            a = bool(self.value(operands[1]))
            b = bool(self.value(operands[2])) if len(operands) > 2 else False
            self.registers[operands[0]] = int({"and": a and b, "or": a or b, "xor": a != b, "not": not a}[name])
            return
        if name == "setp":
            self.compare(parts[1], parts[2], operands)
            return
        if name == "selp":
            width = _width(type_name)
            chosen = operands[1] if self.value(operands[3]) else operands[2]
            self.write(operands[0], self.value(chosen, width), width)
            return
        if name == "mov":
            width = _width(type_name)
            self.write(operands[0], self.value(operands[1], width), width)
            return
        if name == "cvt":
            self.convert(parts, operands)
            return
        if type_name == "f32" or name in ("ex2", "lg2", "rcp", "tanh"):
            self.float_arithmetic(name, operands)
            return
        self.integer_arithmetic(name, parts, type_name, operands)

    def load_store(self, name, space, type_name, operands):
        width = _width(type_name)
        if name == "st":
            sources = [r.strip() for r in operands[1].strip("{}").split(",")]
            base, offset = self.address(operands[0])
            self.accesses.append(Access("st." + space, space, self.value(base) + offset, width // 8 * len(sources),
                                        tuple(self.value(source, width) & _MASKS[width] for source in sources)))
            if space == "shared":
                address = self.accesses[-1].address
                for i, source in enumerate(sources):
                    self.shared_memory[address + i * width // 8] = self.value(source, width) & _MASKS[width]
            return
        registers = [r.strip() for r in operands[0].strip("{}").split(",")]
        base, offset = self.address(operands[1])
        if space == "param":
            data = self.params[base]
            for i, register in enumerate(registers):
                start = offset + i * width // 8
                self.registers[register] = int.from_bytes(data[start:start + width // 8], "little")
            return
        address = self.value(base) + offset
        if space == "shared::cluster":
            self.accesses.append(Access("ld.shared::cluster", "cluster", address, width // 8 * len(registers)))
            for register in registers:
                self.registers[register] = 0
            return
        self.accesses.append(Access("ld." + space, space, address, width // 8 * len(registers)))
        memory = self.shared_memory if space == "shared" else self.global_memory
        for i, register in enumerate(registers):
            loaded = memory.get(address + i * width // 8, 0)
            self.registers[register] = (_signed(loaded, width) & _MASKS[64]) if type_name.startswith("s") \
                else loaded
        return

    def compare(self, comparison, type_name, operands):
        width = _width(type_name)
        a, b = self.value(operands[1], width), self.value(operands[2], width)
        if type_name == "f32":
            a, b = _bits_float(a), _bits_float(b)
            unordered_ok = comparison.endswith("u") and comparison not in _COMPARISONS
            base = comparison[:-1] if unordered_ok else comparison
            result = _COMPARISONS[base](a, b) or (unordered_ok and (a != a or b != b))
        elif type_name.startswith("s"):
            result = _COMPARISONS[comparison](_signed(a, width), _signed(b, width))
        else:
            result = _COMPARISONS[comparison](a & _MASKS[width], b & _MASKS[width])
        self.registers[operands[0]] = int(result)

    def convert(self, parts, operands):
        types = [p for p in parts[1:] if re.match(r"^(bf|[subf])\d+(x2)?$", p)]
        target, source = types[0], types[1]
        if target in ("bf16x2", "f16x2") and source == "f32":
            # d = {a: high half, b: low half}
            high, low = (_half_bits(_bits_float(self.value(o)), target) for o in operands[1:3])
            self.write(operands[0], high << 16 | low, 32)
            return
        if target.startswith(("f", "bf")) or source.startswith(("f", "bf")):
            self.write(operands[0], 0, 32)   # the other float conversions only feed MMA operands here
            return
        source_width, target_width = _width(source), _width(target)
        value = self.value(operands[1])
        value = _signed(value, source_width) if source.startswith("s") else value & _MASKS[source_width]
        if target_width < 32:   # a narrow result in a 32-bit register: its low bits, extended by type
            value &= _MASKS[target_width]
            if target.startswith("s"):
                value = _signed(value, target_width)
        self.write(operands[0], value, max(target_width, 32))

    def float_arithmetic(self, name, operands):
        values = [_bits_float(self.value(o)) for o in operands[1:]]
        try:
            result = {
                "add": lambda: values[0] + values[1], "sub": lambda: values[0] - values[1],
                "mul": lambda: values[0] * values[1], "max": lambda: max(values[0], values[1]),
                "min": lambda: min(values[0], values[1]), "fma": lambda: values[0] * values[1] + values[2],
                "ex2": lambda: 2.0 ** values[0] if values[0] < 128 else math.inf,
                "lg2": lambda: math.log2(values[0]) if values[0] > 0 else -math.inf,
                "rcp": lambda: 1.0 / values[0] if values[0] else math.inf,
                "tanh": lambda: math.tanh(values[0]), "neg": lambda: -values[0], "abs": lambda: abs(values[0]),
            }[name]()
        except KeyError:
            raise NotImplementedError(f"float instruction {name}") from None
        except (OverflowError, ValueError):
            result = math.nan
        self.write(operands[0], _float_bits(result), 32)

    def integer_arithmetic(self, name, parts, type_name, operands):
        if name not in ("add", "sub", "mul", "mad", "div", "rem", "min", "max", "and", "or", "xor", "shl",
                        "shr", "abs", "neg", "not"):
            raise NotImplementedError(".".join(parts))
        width = _width(type_name)
        is_signed = type_name.startswith("s")

        def read(operand):
            value = self.value(operand, width)
            return _signed(value, width) if is_signed else value & _MASKS[width]

        if name == "mul" and parts[1] == "wide":
            self.write(operands[0], read(operands[1]) * read(operands[2]), 2 * width)
            return
        if name == "mul" and parts[1] == "hi":     # division by a constant compiles to this
            self.write(operands[0], (read(operands[1]) * read(operands[2])) >> width, width)
            return
        if name == "mad":
            self.write(operands[0], read(operands[1]) * read(operands[2]) + read(operands[3]), width)
            return
        a = read(operands[1])
        if name in ("abs", "neg", "not"):
            self.write(operands[0], {"abs": abs(a), "neg": -a, "not": ~a}[name], width)
            return
        if name in ("shl", "shr"):
            shift = self.value(operands[2], 32) & _MASKS[32]
            if name == "shl":
                result = a << min(shift, width)
            elif is_signed:
                result = a >> min(shift, width - 1)
            else:
                result = a >> shift if shift < width else 0
            self.write(operands[0], result, width)
            return
        b = read(operands[2])
        if name in ("div", "rem") and b == 0:
            raise ZeroDivisionError(f"{'.'.join(parts)} by zero")
        result = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                  "div": lambda: int(a / b) if is_signed else a // b,     # PTX rounds toward zero
                  "rem": lambda: a - int(a / b) * b if is_signed else a % b,
                  "min": lambda: max(min(a, b), 0) if "relu" in parts else min(a, b), "max": lambda: max(a, b),
                  "and": lambda: a & b, "or": lambda: a | b, "xor": lambda: a ^ b}[name]()
        self.write(operands[0], result, width)


def thread_accesses(program: Program, thread: int, block: tuple, params: dict, global_memory: dict,
                    shared_base: int = 1024, max_steps: int = 2_000_000, shared_memory: dict = None) -> list:
    """The memory accesses of thread `thread` of CTA `block` (ctaid x, y, z), in program order.

    params: {parameter name: its bytes}; global_memory: {byte address: the 32-bit value there}, read by
    global loads (every other address reads 0); shared_base: where dynamic shared memory starts in the
    shared window (after the 1 KB a CTA reserves on sm_90, the first 1024-aligned address);
    shared_memory: {byte address: value} of the CTA's shared memory, updated by this thread's stores
    (pass one dict to every thread of a CTA, in thread order; a fresh one when None)."""
    state = _Thread(program, thread, block, params, global_memory, shared_base,
                    {} if shared_memory is None else shared_memory)
    state.run(max_steps)
    return state.accesses
