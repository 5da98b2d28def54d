"""One description of a warp-specialised kernel's mbarrier protocol, for the kernel and for its CPU check.

A Blackwell kernel's roles (load, MMA, softmax, ...) hand data to each other through mbarriers: which
role waits on which barrier, at which phase, across pipeline stages and persistent tiles, is the part of
the kernel no CPU compile can check and the easiest to get wrong. A `Schedule` states it once:

- the barriers (`Barrier`: stages, the arrivals one phase needs) and the producer/consumer pipelines
  (`Pipeline`: stages, producer and consumer arrivals, TMA bytes per stage, the buffer ring it guards),
  from which the kernel takes its stage counts and `mbarrier_init` counts;
- per role, its program: the ordered synchronisation steps (`Wait`, `Arrive`, `MmaCommit`, pipeline
  `Acquire` / `Commit` / `ConsumerWait` / `Release`, phase `Flip`s) inside the loop structure the kernel
  has (`TileLoop` over persistent tiles, `BlockLoop` over key blocks, `Stages` unrolled over query
  tiles, `Either` for a data-dependent branch whose arms synchronise alike), with the data each step
  between them touches (`Read`, `Write`, `Mma`, `TmaLoad`).

The kernel checks itself against it while it is traced: each synchronisation call in a role method sits
next to `ProtocolTrace.expect(role, kind, name, index)`, which compares the call with the role's next
step in `traced_steps` (each loop body once, as the DSL traces it; `Stages` unrolled; both arms of an
`Either`) and raises on the first difference, so a kernel that compiles issues its waits and arrives in
the order this description says. It adds nothing to the generated code. The CPU test
(tests/test_sm100_protocol.py) replays the same programs, expanded over concrete tiles by `expand`, in a
discrete-event model of mbarriers (tests/protocol_simulator.py).

A CTA pair (2-CTA MMA, cta_group::2) is one schedule over both CTAs: its roles are `cta0.<role>` and
`cta1.<role>` (`Role.cta`; the MMA warp only in the leader, cta0), its barriers and buffers are named by
the CTA that holds them (`cta1.s_full`), a multicast tcgen05.commit names every CTA's barrier, an arrive
on the leader's barrier from the peer names `cta0.…`, `Leader` holds the steps only the leader's copy of
a role runs (the expect_tx that announces both CTAs' TMA bytes), and a pipeline has a producer and a
buffer per CTA. The kernel runs one code copy per role in both CTAs: `ProtocolTrace` checks it against
both CTAs' programs, the kernel naming barriers as templates (`cta{cta}.s_full`: its own CTA's).
`TurnWait` / `TurnPass` are the global-memory turns of a deterministic reduction
(common/ordered_reduction.py), between CTA pairs.

What is described, not checked against the kernel: the data effects (`Read` / `Write` / `Mma` /
`TmaLoad`) and the arrival counts a role contributes (`Role.arrivals`): they state what the kernel's
compute between two synchronisation steps touches and how many threads run the role.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Sequence, Union

# Kinds of synchronisation steps, as `ProtocolTrace.expect` receives them from the kernel.
WAIT = "wait"                  # mbarrier try_wait.parity on a raw barrier
ARRIVE = "arrive"              # mbarrier arrive (every thread of the role)
MMA_COMMIT = "mma_commit"      # tcgen05.commit: arrive once all MMAs issued so far are done
FLIP = "flip"                  # a phase variable toggles
ACQUIRE = "acquire"            # pipeline producer: wait for an empty slot (TMA producers also expect tx)
COMMIT = "commit"              # pipeline producer: the slot is full (a no-op for TMA producers)
CONSUMER_WAIT = "consumer_wait"   # pipeline consumer: wait for a full slot
RELEASE = "release"            # pipeline consumer: the slot is empty again
DRAIN = "drain"                # pipeline producer's tail: wait for a slot's release, fill nothing
EXPECT_TX = "expect_tx"        # one elected arrive announcing TMA bytes on a raw barrier
TURN_WAIT = "turn_wait"        # wait until a global turn counter shows this role's turn
TURN_PASS = "turn_pass"        # pass the turn on (the counter's next value)
SYNC_KINDS = (WAIT, ARRIVE, MMA_COMMIT, FLIP, ACQUIRE, COMMIT, CONSUMER_WAIT, RELEASE, DRAIN, EXPECT_TX,
              TURN_WAIT, TURN_PASS)

# Pipeline kinds (as cutlass.pipeline builds them): who arrives how.
TMA_UMMA = "tma_umma"          # TMA producer (arrive + expected bytes), MMA consumer (tcgen05.commit)
ASYNC = "async"                # thread producer and consumer (plain arrives)


@dataclasses.dataclass(frozen=True)
class Barrier:
    """`stages` mbarriers (one per query tile, ...) each completing a phase after `arrivals` arrives."""

    name: str
    stages: int
    arrivals: int


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A ring of `stages` slots, each with a full and an empty mbarrier, guarding `buffer`.

    `buffer_stages` is how many copies of the buffer exist (the slot's buffer is its index modulo that);
    normally `stages`, a separate number so a test can plant a ring smaller than its pipeline.

    A CTA pair's pipeline (2-CTA MMA, cta_group::2) has one producer role and one buffer per CTA, the
    leader's first: every producer waits on its own CTA's empty barrier and loads its own CTA's half;
    the leader's producer alone arrives and expects `tx_bytes` (both halves) on the leader's full
    barrier, which both halves' copies complete; the consumer (the leader's MMA warp) waits on that and
    releases to every CTA's empty barrier at once (a multicast tcgen05.commit)."""

    name: str
    kind: str
    stages: int
    producer: Union[str, tuple]    # role name, or one per CTA of a pair (leader first)
    consumer: str
    producer_arrivals: int     # arrivals a full barrier's phase needs
    consumer_arrivals: int     # arrivals an empty barrier's phase needs
    buffer: Union[str, tuple]      # buffer name, or one per CTA of a pair
    tx_bytes: int = 0          # bytes a TMA producer's expect_tx announces per slot
    buffer_stages: Optional[int] = None

    @property
    def ring(self) -> int:
        return self.stages if self.buffer_stages is None else self.buffer_stages

    @property
    def producers(self) -> tuple:
        return self.producer if isinstance(self.producer, tuple) else (self.producer,)

    @property
    def buffers(self) -> tuple:
        buffers = self.buffer if isinstance(self.buffer, tuple) else (self.buffer,)
        if len(buffers) != len(self.producers):
            raise ValueError(f"pipeline {self.name}: one buffer per producer")
        return buffers

    def empty_barrier(self, producer: str) -> str:
        """The name of `producer`'s empty barrier array (one per CTA)."""
        return self.name + ".empty" + ("" if len(self.producers) == 1 else f"[{producer}]")


# ---------------------------------------------------------------------------------------------------
# Program steps. `index` is the barrier's stage: an int, STAGE (the enclosing `Stages` loop's stage,
# or the role's own stage for a role run once per query tile), or a callable of the loop variables.
# Each synchronisation step's class names the kind the kernel reports it as (`kind`).

STAGE = "stage"
Index = Union[int, str, Callable]
Tag = Union[str, Callable]     # what a buffer holds: a string, or a callable of the loop variables
Barriers = Union[str, tuple]   # one barrier, or (a multicast commit) one per CTA


@dataclasses.dataclass(frozen=True)
class Wait:
    kind = WAIT
    barrier: str
    index: Index
    phase: str                 # the role's phase variable (starts at 0) whose value the wait uses


@dataclasses.dataclass(frozen=True)
class _OnBarrier:
    barrier: Barriers
    index: Index


class Arrive(_OnBarrier):
    """Every thread of the role arrives (on the peer CTA's barrier where `barrier` names it)."""
    kind = ARRIVE


class MmaCommit(_OnBarrier):
    """tcgen05.commit: arrives once every MMA issued before it is done (on each barrier of a tuple)."""
    kind = MMA_COMMIT


@dataclasses.dataclass(frozen=True)
class ExpectTx:
    """One elected thread arrives on `barrier` and expects `bytes` of TMA copies to complete it."""
    kind = EXPECT_TX
    barrier: str
    index: Index
    bytes: int


@dataclasses.dataclass(frozen=True)
class Flip:
    kind = FLIP
    phase: str


@dataclasses.dataclass(frozen=True)
class _OnPipeline:
    pipeline: str
    handle: str                # name the slot is known by until the next step that names it


class Acquire(_OnPipeline):
    """Producer: wait for an empty slot (a TMA producer also arrives expecting its bytes)."""
    kind = ACQUIRE


class ConsumerWait(_OnPipeline):
    kind = CONSUMER_WAIT


@dataclasses.dataclass(frozen=True)
class _OnHandle:
    handle: str


class Commit(_OnHandle):
    kind = COMMIT


class Release(_OnHandle):
    kind = RELEASE


@dataclasses.dataclass(frozen=True)
class Drain:
    """The producer's tail (cutlass.pipeline's producer_tail, one slot per step): wait until its next
    slot has been released, without filling it. A CTA whose slots a peer's commit releases must see
    that commit land before it exits."""
    kind = DRAIN
    pipeline: str


@dataclasses.dataclass(frozen=True)
class TurnWait:
    """Wait until the global counter `counter`[index] equals `value` (common/ordered_reduction.py's
    wait_for_turn): the reductions of earlier turns are complete."""
    kind = TURN_WAIT
    counter: str
    index: Callable            # of the loop variables: which counter (the output tile)
    value: Callable            # of the loop variables: this role's turn


@dataclasses.dataclass(frozen=True)
class TurnPass:
    """Increment `counter`[index]: the next turn's holder may go (finish_atomic_adds)."""
    kind = TURN_PASS
    counter: str
    index: Callable


# Data effects. A buffer is a name ("tmem_s0") or a pipeline handle's slot ("@k": the buffer of handle k).
# An MMA role's data effects happen in its tcgen05 issue order (they are the MMAs' operands).
@dataclasses.dataclass(frozen=True)
class Read:
    buffer: str
    tag: Tag
    done: bool = True          # the role has finished with this content (its writer may overwrite it)


@dataclasses.dataclass(frozen=True)
class Write:
    buffer: str
    tag: Tag
    readers: Union[tuple, Callable]   # roles that must read (and be done with) it before it is overwritten


@dataclasses.dataclass(frozen=True)
class Mma:
    """One tcgen05.mma (or a chain of them over k-blocks): issued now, executed later, in issue order."""

    reads: tuple               # (buffer, tag, done) triples
    writes: tuple              # (buffer, tag, readers) triples


@dataclasses.dataclass(frozen=True)
class TmaLoad:
    """A TMA copy into a pipeline slot (`handle`) that lands later and then counts `bytes` on the
    slot's full barrier; or, `handle` None, a copy loaded once into `buffer` for `readers`, counting
    on the raw barrier `barrier` (stage 0) that an `ExpectTx` announced."""

    handle: Optional[str]
    tag: Tag
    bytes: int
    buffer: Optional[str] = None
    barrier: Optional[str] = None
    readers: tuple = ()


# Control structure, mirroring the kernel's loops.
@dataclasses.dataclass(frozen=True)
class TileLoop:
    body: tuple


@dataclasses.dataclass(frozen=True)
class BlockLoop:
    """Key blocks first .. (blocks of the tile - end_offset), exclusive: a dynamic loop in the kernel.
    (The sm100 backward's loop is over query blocks: `blocks` counts what the loop walks.)"""

    body: tuple
    first: int = 0
    end_offset: int = 0


@dataclasses.dataclass(frozen=True)
class Stages:
    """The body once per query tile of the CTA (a constexpr-unrolled loop in the kernel)."""

    body: tuple


@dataclasses.dataclass(frozen=True)
class Either:
    """A data-dependent branch (masked / unmasked block): both arms must synchronise alike."""

    first: tuple
    second: tuple


@dataclasses.dataclass(frozen=True)
class Leader:
    """Steps only the pair's leader CTA runs (a branch on the CTA rank in the kernel's one code copy,
    which the kernel traces once, as it does any branch)."""

    body: tuple


@dataclasses.dataclass(frozen=True)
class Role:
    """A role: `arrivals` threads run `program`; `stage` is set for a role run once per query tile,
    `cta` for the copy of a role in one CTA of a pair (named cta<cta>.<kernel role>)."""

    name: str
    program: tuple
    arrivals: int
    stage: Optional[int] = None
    mma: bool = False          # issues tcgen05.mma: its Mma steps and MmaCommits run in issue order
    # (phase variable, initial value) where not 0: a variable starting at 1 lets its first wait pass
    # on a fresh barrier, the way a producer waits for an empty slot.
    initial_phases: tuple = ()
    cta: Optional[int] = None

    @property
    def kernel_role(self) -> str:
        """The name the kernel's role method reports (a pair's roles: without the CTA)."""
        prefix = f"cta{self.cta}."
        return self.name[len(prefix):] if self.cta is not None and self.name.startswith(prefix) else self.name

    def initial_phase(self, phase: str) -> int:
        return dict(self.initial_phases).get(phase, 0)


@dataclasses.dataclass(frozen=True)
class Schedule:
    barriers: tuple
    pipelines: tuple
    roles: tuple
    stages: int                # query tiles per CTA (what `Stages` unrolls over)
    # CTAs that run the schedule together and exit together (a cluster barrier at the kernel's end):
    # where more than one, an arrival still in flight when every role has finished would land in an
    # exited CTA's shared memory.
    cluster: int = 1

    def barrier(self, name: str) -> Barrier:
        return _named(self.barriers, name)

    def pipeline(self, name: str) -> Pipeline:
        return _named(self.pipelines, name)

    def role(self, name: str) -> Role:
        return _named(self.roles, name)

    def replace(self, **changes) -> "Schedule":
        return dataclasses.replace(self, **changes)


def _named(items, name):
    for item in items:
        if item.name == name:
            return item
    raise KeyError(name)


def replace_named(items: tuple, name: str, **changes) -> tuple:
    """`items` with the one called `name` changed (for tests that plant a bug in a schedule)."""
    _named(items, name)
    return tuple(dataclasses.replace(item, **changes) if item.name == name else item for item in items)


# ---------------------------------------------------------------------------------------------------
# Expansion over concrete tiles (what the simulator runs)

@dataclasses.dataclass(frozen=True)
class LoopVariables:
    tile: int = 0              # the CTA's tile counter (0, 1, ... over its persistent tiles)
    blocks: int = 0            # key blocks of the current tile
    block: int = 0             # the current key block, 0-based within the tile
    stage: int = 0             # the query tile within the CTA


def resolve(value, variables: LoopVariables):
    """An index, tag or reader list for the current loop variables."""
    if callable(value):
        return value(variables)
    if value == STAGE:
        return variables.stage
    return value


def expand(schedule: Schedule, role: Role, tile_blocks: Sequence[int],
           choose: Callable[[int], int] = lambda arms: 0) -> Iterator[tuple]:
    """The role's steps over tiles with `tile_blocks[t]` key blocks each, as (step, LoopVariables)
    pairs; `choose(2)` picks the arm of each `Either` (the test's random schedules vary it). A role
    without a `TileLoop` (a kernel that is not persistent) runs one tile: `tile_blocks` has one entry."""
    def walk(steps, variables):
        for step in steps:
            if isinstance(step, TileLoop):
                for tile, blocks in enumerate(tile_blocks):
                    yield from walk(step.body, dataclasses.replace(variables, tile=tile, blocks=blocks))
            elif isinstance(step, BlockLoop):
                for block in range(step.first, variables.blocks - step.end_offset):
                    yield from walk(step.body, dataclasses.replace(variables, block=block))
            elif isinstance(step, Stages):
                if role.stage is not None:
                    raise ValueError(f"role {role.name} runs once per query tile: no Stages in it")
                for stage in range(schedule.stages):
                    yield from walk(step.body, dataclasses.replace(variables, stage=stage))
            elif isinstance(step, Either):
                yield from walk((step.first, step.second)[choose(2)], variables)
            elif isinstance(step, Leader):
                if role.cta in (None, 0):
                    yield from walk(step.body, variables)
            else:
                yield step, variables

    blocks = 0
    if not any(isinstance(step, TileLoop) for step in role.program):
        if len(tile_blocks) != 1:
            raise ValueError(f"role {role.name} runs one tile, not {len(tile_blocks)}")
        blocks = tile_blocks[0]
    yield from walk(role.program, LoopVariables(stage=role.stage or 0, blocks=blocks))


# ---------------------------------------------------------------------------------------------------
# The kernel's trace-time check

def sync_step(step, variables: Optional[LoopVariables] = None):
    """(kind, name, index) of a synchronisation step as the kernel reports it, or None for a data
    effect. Pipeline steps are named by their pipeline, turns by their counter; the index of a
    role-stage or of a callable is None (a dynamic value in the kernel)."""
    def index(value):
        if variables is not None:
            return resolve(value, variables)
        return value if isinstance(value, int) else None
    if isinstance(step, (Wait, _OnBarrier, ExpectTx)):
        return step.kind, step.barrier, index(step.index)
    if isinstance(step, Flip):
        return FLIP, step.phase, None
    if isinstance(step, (_OnPipeline, Drain)):
        return step.kind, step.pipeline, None
    if isinstance(step, _OnHandle):
        handle = step.handle if variables is None else step.handle.format(stage=variables.stage)
        return step.kind, handle, None
    if isinstance(step, (TurnWait, TurnPass)):
        return step.kind, step.counter, None
    return None


@dataclasses.dataclass(frozen=True)
class _Optional:
    steps: tuple


def traced_steps(schedule: Schedule, role_name: str) -> list:
    """The role's synchronisation steps in the order the DSL traces the kernel's role method: every
    loop body once, `Stages` unrolled (the kernel's range_constexpr), both arms of an `Either` (the
    second as an `_Optional` group), a `Leader` body as it stands. Loop bodies are bracketed by
    ("loop", kind) / ("end", kind) markers the kernel reports too."""
    role = schedule.role(role_name)
    out = []

    def walk(steps, stage):
        for step in steps:
            if isinstance(step, (TileLoop, BlockLoop)):
                kind = "tiles" if isinstance(step, TileLoop) else "blocks"
                out.append(("loop", kind, None))
                walk(step.body, stage)
                out.append(("end", kind, None))
            elif isinstance(step, Stages):
                for s in range(schedule.stages):
                    walk(step.body, s)
            elif isinstance(step, Leader):
                walk(step.body, stage)
            elif isinstance(step, Either):
                # A branch on a dynamic value traces both arms; on a constant (a mask without partial
                # blocks, say) only one: the second arm is optional.
                start = len(out)
                walk(step.first, stage)
                arm = len(out)
                walk(step.second, stage)
                if out[start:arm] != out[arm:]:
                    raise ValueError(f"role {role_name}: the arms of a branch synchronise differently: "
                                     f"{out[start:arm]} and {out[arm:]}")
                out[arm:] = [_Optional(tuple(out[arm:]))]
            else:
                sync = sync_step(step, LoopVariables(stage=stage) if stage is not None else None)
                if sync is not None:
                    out.append(sync)

    walk(role.program, None)
    return out


def for_cta(name, cta):
    """A barrier name (or a tuple of them) as the kernel reports it, for the copy in CTA `cta`: the
    template "cta{cta}.s_full" is that CTA's own barrier."""
    if isinstance(name, tuple):
        return tuple(for_cta(item, cta) for item in name)
    return name.format(cta=cta) if cta is not None and "{cta}" in name else name


class ProtocolTrace:
    """Trace-time conformance of a kernel's role methods to a schedule (no code is generated).

    The kernel calls `begin(role)` on entering a role method, `expect(role, kind, name, index)` next to
    each synchronisation call and around each loop (`loop(role, kind)` / `end(role, kind)`), and
    `finish(role)` at the end; any difference from `traced_steps` raises ProtocolMismatch. A role of a
    CTA pair is checked against the programs of both its copies (cta0.<role>, cta1.<role>), each with
    the reported names resolved for its CTA (`for_cta`)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self._expected: dict = {}
        self._position: dict = {}
        self.finished: set = set()

    def start(self):
        """A new trace of the kernel begins."""
        self._expected.clear()
        self._position.clear()
        self.finished = set()

    def _copies(self, role: str) -> list:
        """The schedule's roles that the kernel's role method `role` runs as."""
        copies = [r for r in self.schedule.roles if r.name == role or (r.cta is not None and r.kernel_role == role)]
        if not copies:
            raise KeyError(f"the schedule has no role {role}")
        return copies

    def begin(self, role: str):
        self._expected[role] = {copy.name: (copy.cta, traced_steps(self.schedule, copy.name))
                                for copy in self._copies(role)}
        self._position[role] = 0

    def expect(self, role: str, kind: str, name, index=None):
        if kind not in SYNC_KINDS + ("loop", "end"):
            raise ValueError(f"unknown step kind {kind!r}")
        position = self._position[role]
        for copy, (cta, steps) in self._expected[role].items():
            got = (kind, for_cta(name, cta), index if isinstance(index, int) else None)
            while position < len(steps) and isinstance(steps[position], _Optional):
                group = steps[position].steps
                steps[position:position + 1] = list(group) if group and _matches(group[0], got) else []
            want = steps[position] if position < len(steps) else None
            if want is None or not _matches(want, got):
                raise ProtocolMismatch(
                    f"role {copy}: step {position} of its schedule is {want}, the kernel issues {got}")
        self._position[role] = position + 1

    def loop(self, role: str, kind: str):
        self.expect(role, "loop", kind)

    def end(self, role: str, kind: str):
        self.expect(role, "end", kind)

    def finish(self, role: str):
        position = self._position[role]
        for copy, (cta, steps) in self._expected[role].items():
            steps[position:] = [step for step in steps[position:] if not isinstance(step, _Optional)]
            if position != len(steps):
                raise ProtocolMismatch(
                    f"role {copy}: the kernel stopped after {position} of its schedule's {len(steps)} "
                    f"steps; next expected {steps[position]}")
        self.finished.add(role)

    def check_finished(self):
        """Every role the kernel traces (those of one code copy per query tile: the first; a pair's
        roles by their kernel name) finished."""
        traced = {role.kernel_role for role in self.schedule.roles if role.stage in (None, 0)}
        if self.finished != traced:
            raise ProtocolMismatch(f"roles traced to the end: {sorted(self.finished)}; the schedule "
                                   f"has {sorted(traced)}")


def _matches(want, got) -> bool:
    """A step the schedule indexes by the role's own stage (a dynamic value in the kernel) matches any
    index; a constant index must be the same constant."""
    return want[:2] == got[:2] and (want[2] is None or want[2] == got[2])


class ProtocolMismatch(AssertionError):
    """A kernel's synchronisation calls differ from its schedule (raised while tracing it)."""
