"""Discrete-event model of mbarriers, pipelines and asynchronous copies/MMAs, replaying a kernel's
`pipeline_schedule.Schedule` for one CTA, a CTA pair described as one schedule, or several pairs
(schedules merged with `merge`, sharing global turn counters) over given tiles.

State, as the hardware keeps it: per mbarrier a completed-phase count (its parity is the phase bit),
the arrivals still pending in the current phase and the transaction bytes still expected; per pipeline
participant a (slot, phase, count) state as cutlass.pipeline advances it (producers start at phase 1,
so their first pass over the ring does not wait). A wait on parity p passes when the barrier's phase
bit differs from p, exactly like `mbarrier.try_wait.parity`.

Actors: each role is one sequential actor (a thread group moves as one: its arrive counts as the
role's `arrivals`); each MMA role also owns an in-order queue of issued tcgen05 operations (an MMA
executes, reading and writing its buffers; a commit, once every MMA before it has executed, sends its
arrivals) that drains independently of the issuing thread; a commit's arrivals (one per barrier of a
multicast) land at some later moment each, in any order: the PTX promises an arrival once the MMAs
before it are done, not an order between two commits or two CTAs; each TMA copy lands at some later
moment, writing its buffer and completing its bytes on its barrier. A global turn counter
(`TurnWait` / `TurnPass`) lets its waiter pass when it shows the waiter's value.

A schedule picks which enabled event happens next: random (seeded), or one of three deterministic
ones: "eager" (asynchronous work completes as soon as it can, then each role runs as far as it can),
"lazy" (every role runs as far as it can before any asynchronous work completes,
which lets producers run furthest ahead of their consumers) and "late" (as lazy, and then a TMA copy
lands or a commit's arrival lands only if a blocked role waits on its barrier, the oldest otherwise:
whatever nobody waits for stays in flight as long as it can, so a copy read without its wait, or an
arrival a CTA exits before, shows).

What is checked, each a `Violation` kind:
  deadlock        no event is enabled and some role has not finished
  phase_aliasing  a wait passed before the phase it waits for completed (it passed on an older round's
                  parity), or a wait's phase completed twice over before it passed (a lost round)
  arrive_count    an arrive landed in a later phase than the role's own count says (the phase completed
                  without it, so the barrier's arrival count is smaller than its arrivers), more
                  arrivals than a phase needs, or a phase left half-arrived (arrivals or TMA bytes
                  outstanding) at the end; and statically, a barrier whose arrivers do not add up to
                  its arrival count. (TMA bytes other than those expected leave the phase incomplete:
                  a deadlock, or a read of a half-landed slot.)
  read_unready    a buffer read before its producer's write (or commit) completed, or after the next
                  write replaced it, or by a role it was not written for
  overwrite       a buffer written while a reader of its previous content had not finished with it
  unconsumed      a buffer's content never finished with by a declared reader by the end
  stage_count     a wait or arrive on a barrier stage that does not exist
  late_arrival    (a cluster) every role has finished, so the CTAs exit, while an arrival or a TMA
                  copy is still in flight: it would land in an exited CTA's shared memory (a producer
                  must drain what a peer's commit releases, a consumer wait for what it was sent)
  turn            a turn passed by a role that does not hold it
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Mapping, Optional, Sequence, Union

from fa4_jax.kernels.common import pipeline_schedule as ps

SCHEDULES = ("eager", "lazy", "late", "random")


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    message: str

    def __str__(self):
        return f"{self.kind}: {self.message}"


class _Stop(Exception):
    def __init__(self, violation: Violation):
        self.violation = violation


@dataclasses.dataclass
class _Barrier:
    name: str
    arrivals: int
    pending: int
    tx: int = 0
    completed: int = 0


@dataclasses.dataclass
class _Buffer:
    tag: Optional[str] = None
    pending: list = dataclasses.field(default_factory=list)   # readers not yet done with `tag`


@dataclasses.dataclass
class _PipelineState:
    stages: int
    index: int = 0
    phase: int = 0
    count: int = 0

    def advance(self):
        self.index += 1
        self.count += 1
        if self.index == self.stages:
            self.index = 0
            self.phase ^= 1


@dataclasses.dataclass
class _Slot:
    pipeline: ps.Pipeline
    index: int
    round: int
    buffers: tuple             # a producer's own CTA's slot buffer; the consumer's, every CTA's


class _Actor:
    def __init__(self, role: ps.Role, steps):
        self.role = role
        self.steps = steps
        self.current = next(self.steps, None)
        self.phases = collections.defaultdict(int, dict(role.initial_phases))
        self.initial_phases = dict(role.initial_phases)
        self.handles = {}
        self.pipeline_states = {}
        self.waits = collections.Counter()     # (barrier, index) -> waits passed
        self.arrives = collections.Counter()   # (barrier, index) -> arrives made

    @property
    def done(self):
        return self.current is None

    def advance(self):
        self.current = next(self.steps, None)


class Simulation:
    """`tile_blocks`: the key blocks of each tile every role walks, or per role name (several CTA
    pairs whose walks differ)."""

    def __init__(self, schedule: ps.Schedule, tile_blocks: Union[Sequence[int], Mapping[str, Sequence[int]]],
                 mode: str = "random", seed: int = 0):
        if mode not in SCHEDULES:
            raise ValueError(f"mode {mode!r} not in {SCHEDULES}")
        self.schedule = schedule
        self.mode = mode
        self.rng = random.Random(seed)
        self.barriers = {}
        for barrier in schedule.barriers:
            for index in range(barrier.stages):
                self.barriers[barrier.name, index] = _Barrier(barrier.name, barrier.arrivals,
                                                              barrier.arrivals)
        for pipeline in schedule.pipelines:
            for index in range(pipeline.stages):
                self.barriers[pipeline.name + ".full", index] = _Barrier(
                    pipeline.name + ".full", pipeline.producer_arrivals, pipeline.producer_arrivals)
                for producer in pipeline.producers:
                    empty = pipeline.empty_barrier(producer)
                    self.barriers[empty, index] = _Barrier(empty, pipeline.consumer_arrivals,
                                                           pipeline.consumer_arrivals)
        self.buffers = collections.defaultdict(_Buffer)
        choose = lambda arms: self.rng.randrange(arms)  # noqa: E731
        walks = tile_blocks if isinstance(tile_blocks, Mapping) else {r.name: tile_blocks for r in schedule.roles}
        self.actors = [_Actor(role, ps.expand(schedule, role, walks[role.name], choose))
                       for role in schedule.roles]
        self.mma_queues = {actor.role.name: collections.deque() for actor in self.actors
                           if actor.role.mma}
        self.tma_in_flight = []
        self.arrivals_in_flight = []   # (role, barrier key, count, actor) a commit has sent
        self.counters = collections.Counter()   # (counter, index) -> value
        self.turn_holders = {}                  # (counter, index) -> the role that waited for it
        self.events = 0

    # -------------------------------------------------------------------------------------------
    def run(self, max_events: int = 1_000_000, static_checks: bool = True) -> Optional[Violation]:
        """Replays to the end; the first violation found, or None (`static_checks`: first compare each
        barrier's arrival count with its arrivers, as `check_arrival_counts`)."""
        try:
            static = check_arrival_counts(self.schedule) if static_checks else []
            if static:
                return static[0]
            while self.events < max_events:
                if not self._step():
                    break
                self.events += 1
            self._check_end()
        except _Stop as stop:
            return stop.violation
        return None

    def _step(self) -> bool:
        runnable = [a for a in self.actors if not a.done and self._can_run(a)]
        asynchronous = [("mma", name) for name, queue in self.mma_queues.items() if queue]
        asynchronous += [("tma", i) for i in range(len(self.tma_in_flight))]
        asynchronous += [("arrival", i) for i in range(len(self.arrivals_in_flight))]
        if self.schedule.cluster > 1 and asynchronous and all(a.done for a in self.actors):
            raise _Stop(Violation("late_arrival", "every role has finished, the CTAs exit, with "
                                  + "; ".join(self._in_flight())))
        if not runnable and not asynchronous:
            blocked = [a for a in self.actors if not a.done]
            if blocked:
                raise _Stop(Violation("deadlock", "; ".join(self._blocked_on(a) for a in blocked)))
            return False
        if self.mode == "eager":
            event = asynchronous[0] if asynchronous else runnable[0]
        elif self.mode == "lazy":
            event = runnable[0] if runnable else asynchronous[0]
        elif self.mode == "late":
            event = runnable[0] if runnable else self._latest(asynchronous)
        else:
            choices = runnable + asynchronous
            event = choices[self.rng.randrange(len(choices))]
        if isinstance(event, _Actor):
            self._execute(event)
        elif event[0] == "mma":
            self._drain_mma(event[1])
        elif event[0] == "tma":
            self._land_tma(self.tma_in_flight.pop(event[1]))
        else:
            self._arrive(*self.arrivals_in_flight.pop(event[1]))
        return True

    def _latest(self, asynchronous):
        """The "late" schedule's choice: queued MMAs, or a copy or an arrival some role waits for."""
        waited = set()
        for actor in self.actors:
            target = None if actor.done else self._wait_target(actor, *actor.current)
            if target is not None:
                waited.add(target[0])
        for event in asynchronous:
            if event[0] == "mma":
                return event
            if event[0] == "tma":
                slot, step, _ = self.tma_in_flight[event[1]]
                key = (step.barrier, 0) if slot is None else (slot.pipeline.name + ".full", slot.index)
            else:
                key = self.arrivals_in_flight[event[1]][1]
            if key in waited:
                return event
        return asynchronous[0]

    def _in_flight(self):
        described = [f"{role}'s {entry[0]} queued" for role, queue in self.mma_queues.items() for entry in queue]
        described += [f"a TMA copy of {ps.resolve(step.tag, v)} into "
                      f"{step.buffer if slot is None else slot.buffers}" for slot, step, v in self.tma_in_flight]
        described += [f"{role}'s arrival on {key[0]}[{key[1]}]" for role, key, _, _ in self.arrivals_in_flight]
        return described

    # -------------------------------------------------------------------------------------------
    # Waits
    def _wait_target(self, actor, step, variables):
        """(barrier key, parity the wait uses, completions it is meant to see) or None if no wait."""
        if isinstance(step, ps.Wait):
            key = (step.barrier, self._index(step.index, variables, step.barrier))
            # The k-th wait means the k-th completion; a variable starting at 1 means the (k - 1)-th.
            return (key, actor.phases[step.phase],
                    actor.waits[key] + 1 - actor.initial_phases.get(step.phase, 0))
        if isinstance(step, (ps.Acquire, ps.ConsumerWait, ps.Drain)):
            pipeline = self.schedule.pipeline(step.pipeline)
            producer = not isinstance(step, ps.ConsumerWait)
            state = self._pipeline_state(actor, pipeline, producer=producer)
            if producer:
                # Round r of a slot needs r consumer releases of it.
                return ((pipeline.empty_barrier(actor.role.name), state.index), state.phase,
                        state.count // pipeline.stages)
            return (pipeline.name + ".full", state.index), state.phase, state.count // pipeline.stages + 1
        return None

    def _can_run(self, actor) -> bool:
        step, variables = actor.current
        if isinstance(step, ps.TurnWait):
            return self.counters[self._turn(step, variables)] == ps.resolve(step.value, variables)
        target = self._wait_target(actor, step, variables)
        if target is None:
            return True
        key, parity, _ = target
        if key not in self.barriers:
            raise _Stop(Violation("stage_count", (
                f"{actor.role.name} waits on {key[0]}[{key[1]}], which does not exist")))
        return self.barriers[key].completed % 2 != parity

    def _blocked_on(self, actor) -> str:
        step, variables = actor.current
        if isinstance(step, ps.TurnWait):
            key = self._turn(step, variables)
            return (f"{actor.role.name} waits for turn {ps.resolve(step.value, variables)} of {key[0]}"
                    f"{list(key[1:])} (block {variables.block}; the counter shows {self.counters[key]})")
        key, parity, want = self._wait_target(actor, step, variables)
        barrier = self.barriers[key]
        return (f"{actor.role.name} waits {key[0]}[{key[1]}] parity {parity} (tile {variables.tile}, "
                f"block {variables.block}, stage {variables.stage}; the barrier completed "
                f"{barrier.completed} phases, {barrier.pending} of {barrier.arrivals} arrivals pending)")

    def _pipeline_state(self, actor, pipeline, producer):
        key = (pipeline.name, producer)
        if key not in actor.pipeline_states:
            if actor.role.name not in (pipeline.producers if producer else (pipeline.consumer,)):
                raise _Stop(Violation("arrive_count", f"{actor.role.name} uses pipeline {pipeline.name} "
                                      f"as its {'producer' if producer else 'consumer'}"))
            actor.pipeline_states[key] = _PipelineState(pipeline.stages, phase=1 if producer else 0)
        return actor.pipeline_states[key]

    # -------------------------------------------------------------------------------------------
    def _execute(self, actor):
        step, variables = actor.current
        role = actor.role.name
        target = self._wait_target(actor, step, variables)
        if target is not None:
            key, parity, want = target
            completed = self.barriers[key].completed
            if completed != want:
                problem = ("passed on the previous round's phase" if completed < want
                           else "missed a phase: the barrier completed again before this wait")
                raise _Stop(Violation("phase_aliasing", (
                    f"{role} waited {key[0]}[{key[1]}] (parity {parity}) for phase completion {want} "
                    f"at tile {variables.tile}, block {variables.block}, stage {variables.stage}, and "
                    f"{problem} (completed: {completed})")))
            if isinstance(step, ps.Wait):
                actor.waits[key] += 1
        if isinstance(step, ps.Wait):
            pass
        elif isinstance(step, ps.TurnWait):
            self.turn_holders[self._turn(step, variables)] = role
        elif isinstance(step, ps.TurnPass):
            key = self._turn(step, variables)
            if self.turn_holders.pop(key, None) != role:
                raise _Stop(Violation("turn", f"{role} passes the turn of {key[0]}{list(key[1:])} at "
                                      f"{self.counters[key]}, which it does not hold (block {variables.block})"))
            self.counters[key] += 1
        elif isinstance(step, ps.ExpectTx):
            key = (step.barrier, self._index(step.index, variables, step.barrier))
            if key not in self.barriers:
                raise _Stop(Violation("stage_count", (
                    f"{role} expects bytes on {key[0]}[{key[1]}], which does not exist")))
            self.barriers[key].tx += step.bytes
            self._arrive(role, key, 1, actor)
        elif isinstance(step, ps.Drain):
            self._pipeline_state(actor, self.schedule.pipeline(step.pipeline), producer=True).advance()
        elif isinstance(step, ps.Flip):
            actor.phases[step.phase] ^= 1
        elif isinstance(step, ps.Arrive):
            for name in _names(step.barrier):
                self._arrive(role, (name, self._index(step.index, variables, name)), actor.role.arrivals,
                             actor)
        elif isinstance(step, ps.MmaCommit):
            self._queue_mma(actor, ("commit", step, variables))
        elif isinstance(step, ps.Acquire):
            pipeline = self.schedule.pipeline(step.pipeline)
            state = self._pipeline_state(actor, pipeline, producer=True)
            actor.handles[_fmt(step.handle, variables)] = self._slot(pipeline, state, role)
            if pipeline.kind == ps.TMA_UMMA and role == pipeline.producers[0]:
                full = self.barriers[pipeline.name + ".full", state.index]
                full.tx += pipeline.tx_bytes
                self._arrive(role, (pipeline.name + ".full", state.index), 1, None)
            state.advance()
        elif isinstance(step, ps.ConsumerWait):
            pipeline = self.schedule.pipeline(step.pipeline)
            state = self._pipeline_state(actor, pipeline, producer=False)
            actor.handles[_fmt(step.handle, variables)] = self._slot(pipeline, state, None)
            state.advance()
        elif isinstance(step, ps.Commit):
            slot = self._handle(actor, step.handle, variables)
            if slot.pipeline.kind == ps.ASYNC:
                if len(slot.pipeline.producers) > 1:
                    raise TypeError("a thread-arrive (ASYNC) pipeline has one producer")
                self._arrive(role, (slot.pipeline.name + ".full", slot.index), actor.role.arrivals, None)
        elif isinstance(step, ps.Release):
            slot = self._handle(actor, step.handle, variables)
            if actor.role.mma:
                self._queue_mma(actor, ("release", slot, variables))
            else:
                self._release(role, slot, actor.role.arrivals)
        elif isinstance(step, ps.Read) and actor.role.mma:
            # The MMA warp touches buffers only through its tcgen05 operations: in their order.
            self._queue_mma(actor, ("mma", ([(b, step.tag, step.done) for b in self._buffers(
                actor, step.buffer, variables)], []), variables))
        elif isinstance(step, ps.Read):
            for buffer in self._buffers(actor, step.buffer, variables):
                self._read(role, buffer, step.tag, variables, step.done)
        elif isinstance(step, ps.Write) and actor.role.mma:
            self._queue_mma(actor, ("mma", ([], [(b, step.tag, step.readers) for b in self._buffers(
                actor, step.buffer, variables)]), variables))
        elif isinstance(step, ps.Write):
            for buffer in self._buffers(actor, step.buffer, variables):
                self._write(role, buffer, step.tag, variables, step.readers)
        elif isinstance(step, ps.Mma):
            resolved = ([(buffer, t, d) for b, t, d in step.reads
                         for buffer in self._buffers(actor, b, variables)],
                        [(buffer, t, r) for b, t, r in step.writes
                         for buffer in self._buffers(actor, b, variables)])
            self._queue_mma(actor, ("mma", resolved, variables))
        elif isinstance(step, ps.TmaLoad) and step.handle is None:
            self.tma_in_flight.append((None, step, variables))
        elif isinstance(step, ps.TmaLoad):
            slot = self._handle(actor, step.handle, variables)
            self.tma_in_flight.append((slot, step, variables))
        else:
            raise TypeError(f"unknown step {step!r}")
        actor.advance()

    def _queue_mma(self, actor, entry):
        if not actor.role.mma:
            raise _Stop(Violation("arrive_count", f"{actor.role.name} issues MMA work but is not an MMA role"))
        self.mma_queues[actor.role.name].append(entry)

    def _drain_mma(self, role):
        kind, what, variables = self.mma_queues[role].popleft()
        if kind == "mma":
            reads, writes = what
            for buffer, tag, done in reads:
                self._read(role, buffer, tag, variables, done)
            for buffer, tag, readers in writes:
                self._write(role, buffer, tag, variables, readers)
        elif kind == "commit":
            actor = next(a for a in self.actors if a.role.name == role)
            for name in _names(what.barrier):
                self._send(role, (name, self._index(what.index, variables, name)), 1, actor)
        else:
            self._release(role, what, 1, sent=True)

    def _send(self, role, key, count, actor):
        """A commit's arrival: it lands later, as an event of its own."""
        if key not in self.barriers:
            raise _Stop(Violation("stage_count", f"{role} arrives on {key[0]}[{key[1]}], which does not exist"))
        self.arrivals_in_flight.append((role, key, count, actor))

    def _land_tma(self, flight):
        slot, step, variables = flight
        if slot is None:
            self._write("tma", step.buffer, step.tag, variables, step.readers)
            key = (step.barrier, 0)
            if key not in self.barriers:
                raise _Stop(Violation("stage_count", f"a TMA copy completes on {step.barrier}, which does not exist"))
            barrier = self.barriers[key]
            barrier.tx -= step.bytes
            self._maybe_complete(barrier)
            return
        (buffer,) = slot.buffers
        self._write("tma", buffer, step.tag, variables, (slot.pipeline.consumer,))
        barrier = self.barriers[slot.pipeline.name + ".full", slot.index]
        # As in hardware, the count may go below zero for a while: a CTA pair's peer half can land
        # before the leader's expect_tx. A phase completes only at zero pending arrivals and bytes.
        barrier.tx -= step.bytes
        self._maybe_complete(barrier)

    def _release(self, role, slot, arrivals, sent=False):
        """The consumer is done with the slot; its empty barriers' arrivals land now (threads), or
        later (`sent`: an MMA warp's commit, one arrival per CTA's barrier)."""
        for buffer in slot.buffers:
            self._done(role, buffer)
        for producer in slot.pipeline.producers:
            key = (slot.pipeline.empty_barrier(producer), slot.index)
            if sent:
                self._send(role, key, arrivals, None)
            else:
                self._arrive(role, key, arrivals, None)

    # -------------------------------------------------------------------------------------------
    # Barriers and buffers
    def _arrive(self, role, key, count, actor):
        if key not in self.barriers:
            raise _Stop(Violation("stage_count", f"{role} arrives on {key[0]}[{key[1]}], which does not exist"))
        barrier = self.barriers[key]
        if actor is not None:
            # A role arrives once per phase: its k-th arrive belongs to phase k - 1.
            actor.arrives[key] += 1
            if barrier.completed != actor.arrives[key] - 1:
                raise _Stop(Violation("arrive_count", (
                    f"{role}'s arrive number {actor.arrives[key]} on {key[0]}[{key[1]}] lands in phase "
                    f"{barrier.completed}: the barrier's phases do not count this role's arrivals")))
        if count > barrier.pending:
            raise _Stop(Violation("arrive_count", (
                f"{role} arrives {count} times on {key[0]}[{key[1]}] with only {barrier.pending} of "
                f"{barrier.arrivals} arrivals pending")))
        barrier.pending -= count
        self._maybe_complete(barrier)

    def _maybe_complete(self, barrier):
        if barrier.pending == 0 and barrier.tx == 0:
            barrier.completed += 1
            barrier.pending = barrier.arrivals

    def _index(self, index, variables, name):
        return ps.resolve(index, variables)

    @staticmethod
    def _turn(step, variables):
        return (step.counter, ps.resolve(step.index, variables))

    def _slot(self, pipeline, state, producer):
        """The slot a participant's state points at: a producer's own CTA's buffer, or (producer None,
        the consumer) every CTA's."""
        buffers = [buffer for p, buffer in zip(pipeline.producers, pipeline.buffers)
                   if producer in (None, p)]
        return _Slot(pipeline, state.index, state.count // pipeline.stages,
                     tuple(f"{buffer}[{state.index % pipeline.ring}]" for buffer in buffers))

    def _handle(self, actor, name, variables):
        name = _fmt(name, variables)
        if name not in actor.handles:
            raise _Stop(Violation("read_unready", f"{actor.role.name} uses slot {name} it never acquired"))
        return actor.handles[name]

    def _buffers(self, actor, name, variables):
        if name.startswith("@"):
            return self._handle(actor, name[1:], variables).buffers
        return (_fmt(name, variables),)

    def _read(self, role, buffer, tag, variables, done):
        tag = ps.resolve(tag, variables)
        if tag is None:
            return
        state = self.buffers[buffer]
        if state.tag != tag:
            raise _Stop(Violation("read_unready", (
                f"{role} reads {tag} from {buffer}, which holds {state.tag} (tile {variables.tile}, "
                f"block {variables.block}, stage {variables.stage})")))
        if role not in state.pending:
            raise _Stop(Violation("read_unready", (
                f"{role} reads {tag} from {buffer} but it was written for {state.pending or 'nobody'}")))
        if done:
            state.pending.remove(role)

    def _done(self, role, buffer):
        state = self.buffers[buffer]
        if role in state.pending:
            state.pending.remove(role)

    def _write(self, role, buffer, tag, variables, readers):
        tag = ps.resolve(tag, variables)
        if tag is None:
            return
        state = self.buffers[buffer]
        if state.pending:
            raise _Stop(Violation("overwrite", (
                f"{role} writes {tag} into {buffer} while {state.pending} still need {state.tag}")))
        state.tag = tag
        state.pending = [_fmt(reader, variables) for reader in ps.resolve(readers, variables)]

    def _check_end(self):
        for (name, index), barrier in self.barriers.items():
            if barrier.pending != barrier.arrivals or barrier.tx != 0:
                raise _Stop(Violation("arrive_count", (
                    f"{name}[{index}] ends half-arrived: {barrier.arrivals - barrier.pending} of "
                    f"{barrier.arrivals} arrivals, {barrier.tx} bytes outstanding")))
        for buffer, state in self.buffers.items():
            if state.pending:
                raise _Stop(Violation("unconsumed", f"{buffer} ends holding {state.tag} for {state.pending}"))


def _names(barrier):
    return barrier if isinstance(barrier, tuple) else (barrier,)


def _fmt(name, variables):
    return name.format(stage=variables.stage)


def check_arrival_counts(schedule: ps.Schedule) -> list:
    """Static: each barrier's arrival count equals the arrivals its arriving roles contribute per phase
    (a role's threads for Arrive, 1 for an MmaCommit's or an ExpectTx's elected thread)."""
    contributions = collections.defaultdict(dict)
    for role in schedule.roles:
        for step, variables in _all_steps(schedule, role):
            if isinstance(step, (ps.Arrive, ps.MmaCommit, ps.ExpectTx)):
                count = role.arrivals if isinstance(step, ps.Arrive) else 1
                for name in _names(step.barrier):
                    contributions[name, ps.resolve(step.index, variables)][role.name] = count
    violations = []
    for barrier in schedule.barriers:
        for index in range(barrier.stages):
            total = sum(contributions[barrier.name, index].values())
            if total != barrier.arrivals:
                violations.append(Violation("arrive_count", (
                    f"{barrier.name}[{index}] is initialised for {barrier.arrivals} arrivals; its arrivers "
                    f"{contributions[barrier.name, index] or 'none'} make {total}")))
    return violations


def _all_steps(schedule, role):
    """Every step of the role once per stage, over a tile of three blocks (enough to reach each)."""
    seen = []
    for arm in (0, 1):
        seen.extend(ps.expand(schedule, role, [3], lambda arms, arm=arm: arm))
    return seen


def replay(schedule: ps.Schedule, tile_blocks, seeds: int = 50,
           static_checks: bool = True) -> list:
    """(mode, seed, Violation) of every run that found one, over the eager, lazy and late schedules and
    `seeds` random ones."""
    found = []
    runs = [("eager", 0), ("lazy", 0), ("late", 0)] + [("random", seed) for seed in range(seeds)]
    for mode, seed in runs:
        violation = Simulation(schedule, tile_blocks, mode, seed).run(static_checks=static_checks)
        if violation is not None:
            found.append((mode, seed, violation))
    return found


def map_steps(program: tuple, change) -> tuple:
    """`program` with each step replaced by the tuple `change(step)` returns (None: keep the step),
    inside every loop and branch: how a test plants a bug in a schedule."""
    out = []
    for step in program:
        replaced = change(step)
        if replaced is not None:
            out.extend(replaced)
        elif isinstance(step, (ps.TileLoop, ps.BlockLoop, ps.Stages, ps.Leader)):
            out.append(dataclasses.replace(step, body=map_steps(step.body, change)))
        elif isinstance(step, ps.Either):
            out.append(ps.Either(map_steps(step.first, change), map_steps(step.second, change)))
        else:
            out.append(step)
    return tuple(out)


def change_role(schedule: ps.Schedule, role: str, change) -> ps.Schedule:
    """The schedule with `map_steps(program, change)` applied to the programs of the roles whose
    name starts with `role`."""
    return schedule.replace(roles=tuple(
        dataclasses.replace(r, program=map_steps(r.program, change)) if r.name.startswith(role) else r
        for r in schedule.roles))


def merge(*schedules: ps.Schedule) -> ps.Schedule:
    """One schedule of several (CTA pairs with distinct names) run at once: what connects them is the
    global turn counters their roles share."""
    return ps.Schedule(barriers=sum((s.barriers for s in schedules), ()),
                       pipelines=sum((s.pipelines for s in schedules), ()),
                       roles=sum((s.roles for s in schedules), ()),
                       stages=max(s.stages for s in schedules), cluster=max(s.cluster for s in schedules))
