"""The Layer 1 state machine (DESIGN.md) under random interleavings, on the real database.

A hypothesis ``RuleBasedStateMachine`` plays several workers, each a thread with its own
database connection, claiming, completing, failing and racing on a few keys in two scopes, while
time moves on (leases and TTLs expired by moving their deadlines into the past, which is what
the engine reads). A model predicts every decision; the invariants hold after every step:

- at most one effect per (scope, key) commits in each life of a record (effects are rows written
  in the same transaction as the completion), and exactly the model's;
- a completed key replays the response that committed with its effect;
- a fenced-out worker's completion fails and its effect rolls back;
- no key stays blocked after its lease: once it ran out, a claim takes the key over.

Then real threads race claim/complete/release on many keys with the same invariant.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import pytest
from django.db import connection
from django.http import HttpResponse, HttpResponseBase
from django.test import override_settings
from django.utils import timezone
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from django_idempotency.core import types
from django_idempotency.db import session_locks
from django_idempotency.db.querysets import COMPLETED, PROCESSING
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import sweeps
from django_idempotency.request import lifecycle, store
from tests.reliability.corpus import bounded
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

T = TypeVar("T")
WORKERS = 3
SLOTS = [("tenant:a", "k1"), ("tenant:a", "k2"), ("tenant:b", "k1")]
#: Mostly the same request (retries), sometimes another one under the same key (a 422).
FINGERPRINTS = ["a" * 64, "a" * 64, "a" * 64, "b" * 64]
#: Long enough that no lease runs out by itself while a step runs on a slow machine: leases
#: expire only when a rule says so.
LEASE_SECONDS = 600


class BoomError(RuntimeError):
    pass


class Worker:
    """One simulated web worker: a thread of its own, hence a database connection of its own."""

    def __init__(self, name: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, function: Callable[[], T]) -> T:
        return self.pool.submit(function).result(timeout=120)

    def stop(self) -> None:
        # A lambda: ``connection.close`` evaluated here would be this thread's connection.
        self.pool.submit(lambda: connection.close()).result(timeout=120)
        self.pool.shutdown()


def effect_name(lease: types.Lease) -> str:
    return f"{lease.identity.scope}|{lease.identity.key}|{lease.owner_token}"


def effect_body(lease: types.Lease) -> bytes:
    return f'{{"owner": "{lease.owner_token}"}}'.encode()


def run_to_completion(lease: types.Lease) -> HttpResponseBase:
    """The lifecycle's own ``run``: the effect and the completion in one transaction."""

    def view() -> HttpResponse:
        Widget.objects.create(name=effect_name(lease))
        return HttpResponse(effect_body(lease), status=201, content_type="application/json")

    return lifecycle.run(lease, view)


def run_to_failure(lease: types.Lease, mode: str) -> None:
    """The view writes its effect, then raises or answers 500: both roll it back and release."""

    def view() -> HttpResponse:
        Widget.objects.create(name=effect_name(lease))
        if mode == "raise":
            raise BoomError("the view failed after writing")
        return HttpResponse(b"oops", status=500)

    with contextlib.suppress(BoomError):
        lifecycle.run(lease, view)


@dataclass
class Slot:
    """What the model expects of one (scope, key)."""

    state: str = "absent"  # absent | PROCESSING | COMPLETED
    owner: uuid.UUID | None = None
    fingerprint: str | None = None
    attempts: int = 0
    lease_expired: bool = False
    ttl_expired: bool = False
    response: bytes | None = None
    #: A life starts when a claim inserts the record afresh (or reuses an expired one).
    life: int = 0
    #: Owner tokens whose effect committed, with the life each committed in.
    committed: list[tuple[int, uuid.UUID]] = field(default_factory=list)
    #: The worker whose session holds the running owner's lock (owner locks on PostgreSQL).
    holder: int | None = None

    def claimable(self) -> bool:
        return self.state == "absent" or (
            self.ttl_expired and (self.state == COMPLETED or self.lease_expired)
        )


@dataclass(frozen=True)
class Held:
    """A lease a worker holds, and which worker."""

    lease: types.Lease
    worker: int


class LeaseMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.prefix = uuid.uuid4().hex[:8]
        self.workers = [Worker(f"worker-{n}") for n in range(WORKERS)]
        self.slots = {slot: Slot() for slot in SLOTS}
        self.stats: Counter[str] = STATS

    def teardown(self) -> None:
        for worker in self.workers:
            worker.stop()

    # --- helpers ---

    def identity(self, slot: tuple[str, str], fingerprint: str) -> types.Identity:
        scope, key = slot
        return types.Identity(
            scope=scope,
            key=f"{self.prefix}-{key}",
            fingerprint=fingerprint,
            method="POST",
            path="/machine/",
        )

    def records(self, slot: tuple[str, str]) -> Any:
        scope, key = slot
        return IdempotencyRecord.objects.filter(scope=scope, key=f"{self.prefix}-{key}")

    def expect_claim(self, slot: tuple[str, str], fingerprint: str, worker: int | None) -> str:
        """The decision the model predicts, and the model's new state if it is a claim.

        With owner locks, a running lease held by the claiming worker's own session counts as
        an owner that is gone: one session never runs two requests at once.
        """
        model = self.slots[slot]
        if model.claimable():
            return "fresh"
        if model.fingerprint != fingerprint:
            return "mismatch"
        if model.state == COMPLETED:
            return "replay"
        if not model.lease_expired:
            if worker is not None and worker == model.holder and session_locks.enabled("default"):
                return "takeover"
            return "conflict"
        return "takeover"

    def claimed(
        self, slot: tuple[str, str], lease: types.Lease, expected: str, worker: int
    ) -> None:
        model = self.slots[slot]
        model.holder = worker
        if expected == "fresh":
            model.life += 1
            model.attempts = 1
        else:
            model.attempts += 1
        model.state, model.owner = PROCESSING, lease.owner_token
        model.fingerprint = lease.identity.fingerprint
        model.lease_expired = model.ttl_expired = False
        model.response = None
        assert lease.attempt == model.attempts, (lease.attempt, model.attempts)

    def check_decision(
        self, slot: tuple[str, str], decision: types.Decision, expected: str, worker: int
    ) -> types.Lease | None:
        self.stats[f"claim:{expected}"] += 1
        if expected in ("fresh", "takeover"):
            assert isinstance(decision, types.Proceed), (expected, decision)
            self.claimed(slot, decision.lease, expected, worker)
            return decision.lease
        if expected == "replay":
            assert isinstance(decision, types.Replay), (expected, decision)
            assert decision.response.body == self.slots[slot].response
            assert decision.response.status == 201
        elif expected == "conflict":
            assert isinstance(decision, types.Conflict), (expected, decision)
            assert decision.retry_after >= 1
        else:
            assert isinstance(decision, types.Mismatch), (expected, decision)
        return None

    # --- rules ---

    @rule(
        target=leases,
        slot=st.sampled_from(SLOTS),
        fingerprint=st.sampled_from(FINGERPRINTS),
        offset=st.integers(0, WORKERS - 1),
    )
    def claim(self, slot: tuple[str, str], fingerprint: str, offset: int) -> Any:
        """One worker claims. The worker is drawn relative to the key's holder (offset 0: the
        holder itself), since which worker won an earlier race is up to the threads: drawn
        absolutely, the same draws could mean "the holder's session" in one run and "another
        session" in the next, and Hypothesis rejects a test whose outcomes its draws do not
        decide."""
        holder = self.slots[slot].holder
        worker = offset if holder is None else (holder + offset) % WORKERS
        expected = self.expect_claim(slot, fingerprint, worker)
        ident = self.identity(slot, fingerprint)
        decision = self.workers[worker].call(lambda: lifecycle.claim(ident))
        lease = self.check_decision(slot, decision, expected, worker)
        return multiple() if lease is None else Held(lease, worker)

    @rule(target=leases, slot=st.sampled_from(SLOTS), fingerprint=st.sampled_from(FINGERPRINTS))
    def race(self, slot: tuple[str, str], fingerprint: str) -> Any:
        """Every worker claims the same key at the same instant: one may run, at most. (With
        owner locks, a running lease's own worker is the one that may: its session is free.)"""
        holder = self.slots[slot].holder
        expected = self.expect_claim(slot, fingerprint, holder)
        ident = self.identity(slot, fingerprint)
        barrier = threading.Barrier(WORKERS)

        def contend() -> types.Decision:
            barrier.wait(60)
            return lifecycle.claim(ident)

        futures = [worker.pool.submit(contend) for worker in self.workers]
        decisions = [future.result(timeout=120) for future in futures]
        self.stats["race"] += 1
        winners = [(index, d) for index, d in enumerate(decisions) if isinstance(d, types.Proceed)]
        if expected in ("fresh", "takeover"):
            assert len(winners) == 1, decisions
            index, won = winners[0]
            if expected == "takeover" and not self.slots[slot].lease_expired:
                assert index == holder, (index, holder, decisions)
            self.check_decision(slot, won, expected, index)
            for other in decisions:
                if other is not won:  # the others find the winner's running lease
                    assert isinstance(other, types.Conflict), decisions
            return Held(won.lease, index)
        for index, decision in enumerate(decisions):
            self.check_decision(slot, decision, expected, index)
        return multiple()

    @rule(held=consumes(leases))
    def complete(self, held: Held) -> None:
        """The view's effect and the completion commit together, or neither does."""
        lease = held.lease
        slot = (lease.identity.scope, lease.identity.key.split("-", 1)[1])
        model = self.slots[slot]
        owns = model.state == PROCESSING and model.owner == lease.owner_token
        try:
            response = self.workers[held.worker].call(lambda: run_to_completion(lease))
        except LeaseLostConflict:
            assert not owns, "the owner's completion failed"
            self.stats["complete:fenced"] += 1
            return
        assert owns, "a fenced-out worker completed"
        assert response.status_code == 201
        self.stats["complete:ok"] += 1
        model.state, model.response = COMPLETED, effect_body(lease)
        model.ttl_expired = model.lease_expired = False
        model.committed.append((model.life, lease.owner_token))

    @rule(held=consumes(leases), mode=st.sampled_from(["raise", "500"]))
    def fail(self, held: Held, mode: str) -> None:
        """A failing view rolls its effect back and releases the key, if it still owns it."""
        lease = held.lease
        slot = (lease.identity.scope, lease.identity.key.split("-", 1)[1])
        model = self.slots[slot]
        self.workers[held.worker].call(lambda: run_to_failure(lease, mode))
        self.stats["fail"] += 1
        if model.state == PROCESSING and model.owner == lease.owner_token:
            self.slots[slot] = Slot(life=model.life, committed=model.committed)

    def running(self) -> list[tuple[str, str]]:
        return [s for s, m in self.slots.items() if m.state == PROCESSING and not m.lease_expired]

    def live(self) -> list[tuple[str, str]]:
        """Records whose TTL may run out: completed ones, and running ones already stale (a
        running request's record outlives its lease by the whole TTL)."""
        return [
            s
            for s, m in self.slots.items()
            if not m.ttl_expired
            and (m.state == COMPLETED or (m.state == PROCESSING and m.lease_expired))
        ]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def lease_runs_out(self, data: st.DataObject) -> None:
        """Time passes for a running request: its lease is over (the worker may still run)."""
        slot = data.draw(st.sampled_from(self.running()))
        past = timezone.now() - timedelta(seconds=1)
        self.records(slot).filter(status=PROCESSING).update(lease_expires_at=past)
        self.slots[slot].lease_expired = True
        self.stats["lease expired"] += 1

    def stale(self) -> list[tuple[str, str]]:
        return [s for s, m in self.slots.items() if m.state == PROCESSING and m.lease_expired]

    @precondition(lambda self: self.stale())
    @rule(target=leases, data=st.data())
    def retry_after_the_lease(self, data: st.DataObject) -> Any:
        """No key stays blocked after its lease: the client's retry takes the key over."""
        slot = data.draw(st.sampled_from(self.stale()))
        worker = data.draw(st.integers(0, WORKERS - 1))
        fingerprint = self.slots[slot].fingerprint
        assert fingerprint is not None
        expected = self.expect_claim(slot, fingerprint, worker)
        assert expected in ("takeover", "fresh"), expected
        ident = self.identity(slot, fingerprint)
        decision = self.workers[worker].call(lambda: lifecycle.claim(ident))
        lease = self.check_decision(slot, decision, expected, worker)
        assert lease is not None
        return Held(lease, worker)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def ttl_runs_out(self, data: st.DataObject) -> None:
        """A day passes: the record's TTL is over (and any lease on it)."""
        slot = data.draw(st.sampled_from(self.live()))
        past = timezone.now() - timedelta(seconds=1)
        self.records(slot).filter(status=PROCESSING).update(expires_at=past, lease_expires_at=past)
        self.records(slot).filter(status=COMPLETED).update(expires_at=past)
        model = self.slots[slot]
        model.ttl_expired = True
        model.lease_expired = model.state == PROCESSING
        self.stats["ttl expired"] += 1

    @precondition(
        lambda self: any(m.state != "absent" and m.claimable() for m in self.slots.values())
    )
    @rule()
    def sweep(self) -> None:
        """The sweep deletes what expired; claims never waited for it."""
        sweeps.sweep_expired_records()
        for slot, model in self.slots.items():
            if model.state != "absent" and model.claimable():
                self.slots[slot] = Slot(life=model.life, committed=model.committed)
        self.stats["sweep"] += 1

    @precondition(lambda self: any(m.state == COMPLETED for m in self.slots.values()))
    @rule(data=st.data())
    def replay_from_another_worker(self, data: st.DataObject) -> None:
        """Any worker, any time: a completed key replays what committed with its effect."""
        slot = data.draw(
            st.sampled_from([s for s, m in self.slots.items() if m.state == COMPLETED])
        )
        worker = data.draw(st.integers(0, WORKERS - 1))
        fingerprint = self.slots[slot].fingerprint
        assert fingerprint is not None
        expected = self.expect_claim(slot, fingerprint, worker)
        ident = self.identity(slot, fingerprint)
        decision = self.workers[worker].call(lambda: lifecycle.claim(ident))
        assert self.check_decision(slot, decision, expected, worker) is None or expected == "fresh"
        if isinstance(decision, types.Proceed):  # the TTL was over: release what we took
            self.workers[worker].call(lambda: store.release(decision.lease))
            self.slots[slot] = Slot(
                life=self.slots[slot].life, committed=self.slots[slot].committed
            )

    # --- invariants ---

    @invariant()
    def database_agrees_with_the_model(self) -> None:
        for slot, model in self.slots.items():
            record = self.records(slot).first()
            if model.state == "absent":
                assert record is None, (slot, record)
                continue
            assert record is not None, (slot, model)
            assert (record.status, record.owner_token) == (model.state, model.owner), slot
            assert (record.fingerprint, record.attempts) == (model.fingerprint, model.attempts)
            if model.state == COMPLETED:
                assert bytes(record.response_body or b"") == model.response
                assert record.lease_expires_at is None and record.completed_at is not None

    @invariant()
    def one_effect_per_life_and_only_the_committed_ones(self) -> None:
        for slot, model in self.slots.items():
            scope, key = slot
            names = Widget.objects.filter(
                name__startswith=f"{scope}|{self.prefix}-{key}|"
            ).values_list("name", flat=True)
            owners = sorted(name.rsplit("|", 1)[1] for name in names)
            assert owners == sorted(str(owner) for _life, owner in model.committed), slot
            lives = Counter(life for life, _owner in model.committed)
            assert all(count == 1 for count in lives.values()), lives
            if model.state == COMPLETED:
                assert model.committed[-1][1] == model.owner  # the replayed one is the effect


STATS: Counter[str] = Counter()


def test_random_interleavings_of_workers_keep_the_invariants() -> None:
    """Hypothesis drives claims, races, completions, failures, lease and TTL expiry and sweeps
    from three workers on three keys, checking the model and the invariants after every step."""
    STATS.clear()
    started = time.monotonic()
    settings = bounded(25, stateful_step_count=40)
    with override_settings(IDEMPOTENCY={"LEASE_SECONDS": LEASE_SECONDS}):
        run_state_machine_as_test(LeaseMachine, settings=settings)
    elapsed = time.monotonic() - started
    print(f"\nstate machine: {sum(STATS.values())} steps in {elapsed:.1f} s: {dict(STATS)}")
    assert STATS["complete:ok"] and STATS["complete:fenced"] and STATS["claim:takeover"]
    assert STATS["claim:replay"] and STATS["claim:conflict"] and STATS["claim:mismatch"]


# --- real threads ---------------------------------------------------------------------------

THREADS = 8
KEYS = 60
ATTEMPTS = 8


def test_threads_racing_on_many_keys_commit_at_most_one_effect_per_key() -> None:
    """8 threads, each with its own connection, claim each key at the same instant and retry on
    409 like clients; a winner completes, fails, dies (its lease runs out) or overruns its lease
    (so another thread may take over and fence its late completion out). At the end every key
    has at most one effect, and a completed key has exactly one: the one it replays."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    prefix = uuid.uuid4().hex[:8]
    keys = [f"{prefix}-{n}" for n in range(KEYS)]
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def identity(key: str) -> types.Identity:
        return types.Identity("tenant:race", key, "c" * 64, "POST", "/race/")

    def expire(key: str, lease: types.Lease) -> None:
        IdempotencyRecord.objects.filter(
            scope="tenant:race", key=key, owner_token=lease.owner_token
        ).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    def work(seed: int) -> None:
        rng = random.Random(seed)
        seen: Counter[str] = Counter()
        try:
            for key in keys:
                barrier.wait(60)  # every thread on the same key at the same instant
                for _attempt in range(ATTEMPTS):
                    decision = lifecycle.claim(identity(key))
                    seen[type(decision).__name__] += 1
                    if isinstance(decision, types.Replay):
                        break
                    if isinstance(decision, types.Conflict):
                        time.sleep(rng.random() * 0.01)  # a client retrying soon
                        continue
                    assert isinstance(decision, types.Proceed), decision
                    lease = decision.lease
                    action = rng.choices(["complete", "fail", "overrun", "die"], [4, 2, 3, 1])[0]
                    seen[action] += 1
                    if action == "fail":
                        run_to_failure(lease, rng.choice(["raise", "500"]))
                        continue
                    if action == "die":  # the process died mid-request: its lease runs out
                        expire(key, lease)
                        break
                    if action == "overrun":  # outlives its lease: a retry may take over
                        expire(key, lease)
                        time.sleep(rng.random() * 0.02)
                    try:
                        run_to_completion(lease)
                        seen["completed"] += 1
                        break
                    except LeaseLostConflict:
                        seen["fenced"] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            with lock:
                counts.update(seen)
            connection.close()

    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(THREADS)]
    with override_settings(IDEMPOTENCY={"LEASE_SECONDS": LEASE_SECONDS}):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    elapsed = time.monotonic() - started
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)

    effects = Counter(
        name.split("|")[1]
        for name in Widget.objects.filter(name__startswith="tenant:race|").values_list(
            "name", flat=True
        )
    )
    assert max(effects.values(), default=0) <= 1, effects.most_common(3)
    completed = 0
    for record in IdempotencyRecord.objects.filter(scope="tenant:race", key__in=keys):
        owners = list(
            Widget.objects.filter(name__startswith=f"tenant:race|{record.key}|").values_list(
                "name", flat=True
            )
        )
        if record.status == COMPLETED:
            completed += 1
            assert owners == [f"tenant:race|{record.key}|{record.owner_token}"], owners
            replay = lifecycle.claim(identity(record.key))
            assert isinstance(replay, types.Replay)
            assert replay.response.body == f'{{"owner": "{record.owner_token}"}}'.encode()
        else:
            assert owners == [], (record.key, owners)
    claims = sum(counts[name] for name in ("Proceed", "Conflict", "Replay", "Mismatch"))
    print(
        f"\n{THREADS} threads x {KEYS} keys: {claims} claims in {elapsed:.1f} s "
        f"({claims / elapsed:.0f}/s), {completed} keys completed, {dict(counts)}"
    )
    assert counts["completed"] and counts["Conflict"] and counts["Replay"] and counts["fenced"]
