"""Membership on a virtual clock: joins converge, deaths spread fast, loss causes no false
deaths, suspicions are refuted, capacity records propagate and forgeries are dropped, garbage
never crashes anything, and the gossip stays within its byte budget.

Every multi-node test runs the simulator (meshd/sim/simnet.py): real state machines, real codec, real Ed25519,
a seeded network. Bounds asserted here are the ones docs/membership.md states.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from meshd.mesh.broadcast import BroadcastQueue
from meshd.mesh.membership import (
    EventKind,
    LocalCapacity,
    Membership,
    MembershipConfig,
    Status,
)
from meshd.sim.gossip_load import measure_gossip_load
from meshd.sim.simnet import Sim, SimLink, SimNode, signer, verify_ed25519
from protocol.errors import RemoteProtocolError
from protocol.gossip import (
    MAX_GOSSIP_BYTES,
    Ack,
    CapacityRecord,
    Gossip,
    MemberUpdate,
    ModelHolding,
    Ping,
    PingReq,
    SignedRecord,
    SyncDigest,
    SyncReply,
    Want,
    decode,
    encode,
    read_record,
    sign_record,
)

LANE_DEAD_AFTER_S = 1.5


def converged_sim(n: int, *, seed: int = 0, loss: float = 0.0, lanes: bool = True) -> Sim:
    sim = Sim(n, seed=seed, link=SimLink(loss=loss), lanes=lanes)
    sim.start_all()
    assert sim.wait_for(sim.converged, timeout_s=10.0) < math.inf
    return sim


# ---- join -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "seed"), [(10, 0), (10, 1), (30, 2)])
def test_join_converges_within_two_seconds(n: int, seed: int) -> None:
    sim = Sim(n, seed=seed, link=SimLink(loss=0.01))
    sim.start_all(stagger_s=0.01)
    took = sim.wait_for(sim.converged, timeout_s=10.0)
    print(f"\njoin of {n} nodes (1% loss) converged {took:.2f} s after the last join")
    assert took <= 2.0
    # Everyone also holds everyone's signed capacity record (the address comes from it).
    took_records = sim.wait_for(
        lambda: all(
            info.address.endswith(str(7000 + sim.index_of[nid]))
            for node in sim.nodes
            for nid, info in node.m.view().items()
        ),
        timeout_s=10.0,
    )
    assert took_records <= 2.0
    assert not sim.events_of(EventKind.DIED)


def test_node_started_late_joins_through_any_member() -> None:
    sim = Sim(6, seed=3)
    for i in range(5):
        sim.start(i)
        if i:
            sim.join(i, 0)
    assert sim.wait_for(sim.converged, timeout_s=3.0) < math.inf
    sim.run_for(5.0)
    sim.start(5)
    sim.join(5, 3)  # not the original seed
    assert sim.wait_for(sim.converged, timeout_s=2.0) <= 1.0
    joined = {(obs, e.node_id) for obs, e in sim.events_of(EventKind.JOINED)}
    assert {obs for obs, nid in joined if nid == sim.nodes[5].node_id} == set(range(5))


# ---- failure detection ------------------------------------------------------------------


def test_killed_node_known_dead_everywhere_within_lane_timeout_plus_a_round() -> None:
    sim = converged_sim(10, seed=4, loss=0.01)
    sim.run_for(12.0)  # round-robin probes have opened lanes between the members
    sim.kill(6)
    took = sim.wait_for(lambda: sim.all_see(6, (Status.DEAD,)), timeout_s=10.0, step_s=0.01)
    print(f"\ncrash known dead everywhere after {took:.2f} s (lane timeout {LANE_DEAD_AFTER_S} s)")
    assert took <= LANE_DEAD_AFTER_S + 1.0
    died = {obs for obs, e in sim.events_of(EventKind.DIED) if e.node_id == sim.nodes[6].node_id}
    assert died == set(range(10)) - {6}
    assert sim.converged()


def test_killed_node_detected_by_swim_probes_alone() -> None:
    sim = converged_sim(10, seed=5, loss=0.01, lanes=False)
    sim.run_for(5.0)
    sim.kill(2)
    took = sim.wait_for(lambda: sim.all_see(2, (Status.DEAD,)), timeout_s=20.0, step_s=0.01)
    print(f"\ncrash known dead everywhere after {took:.2f} s by probes alone (no lanes)")
    assert took <= 8.0


def test_no_false_death_with_one_percent_loss_over_a_long_run() -> None:
    sim = converged_sim(12, seed=6, loss=0.01, lanes=False)
    sim.run_for(300.0)
    suspicions = len(sim.events_of(EventKind.SUSPECTED))
    print(f"\n300 s, 12 nodes, 1% loss, probes only: {suspicions} suspicions, all refuted")
    assert not sim.events_of(EventKind.DIED)
    assert sim.converged()


def test_broken_path_between_two_members_kills_neither() -> None:
    sim = converged_sim(8, seed=7)
    sim.run_for(10.0)
    sim.block(0, 5)  # lanes between 0 and 5 die; everyone else still reaches both
    sim.run_for(30.0)
    assert not sim.events_of(EventKind.DIED)
    assert sim.converged()
    view = sim.nodes[0].m.view()
    assert not view[sim.nodes[5].node_id].lane_up
    assert view[sim.nodes[5].node_id].healthy


def test_partial_connectivity_converges_without_deaths() -> None:
    sim = Sim(12, seed=8, link=SimLink(loss=0.01))
    # A quarter of the paths among nodes 1..11 are filtered (never connect); every node
    # still reaches the join seed, node 0, and most others.
    for i in range(1, 12):
        for j in range(i + 1, 12):
            if sim.rng.random() < 0.25:
                sim.block(i, j)
    assert len(sim.blocked) >= 8
    sim.start_all()
    assert sim.wait_for(sim.converged, timeout_s=15.0) < math.inf
    sim.run_for(120.0)
    suspicions = sum(node.m.stats.suspicions for node in sim.nodes)
    print(f"\n{len(sim.blocked)} of 55 paths filtered, 120 s: {suspicions} suspicions, no deaths")
    assert not sim.events_of(EventKind.DIED)
    assert sim.wait_for(sim.converged, timeout_s=5.0) < math.inf


def incarnation(node: SimNode, node_id: bytes) -> int | None:
    """The incarnation `node` holds for `node_id` (None if unknown)."""
    info = node.m.view().get(node_id)
    return info.incarnation if info is not None else None


def test_suspected_but_alive_node_refutes() -> None:
    sim = converged_sim(8, seed=9)
    victim = sim.nodes[3]
    before = incarnation(victim, victim.node_id)
    assert before is not None
    lie = MemberUpdate(victim.node_id, Status.SUSPECT, before, 0, sim.nodes[2].node_id)
    sim.inject(1, 2, Gossip(updates=[lie], records=[]))
    assert sim.status_seen(1, 3) is Status.SUSPECT
    took = sim.wait_for(
        lambda: (
            all(incarnation(n, victim.node_id) == before + 1 for n in sim.nodes)
            and sim.all_see(3, (Status.ALIVE,))
        ),
        timeout_s=5.0,
        step_s=0.01,
    )
    print(f"\nsuspicion refuted everywhere after {took:.2f} s")
    assert took <= 1.0
    assert victim.m.stats.refutations == 1
    sim.run_for(10.0)
    assert not sim.events_of(EventKind.DIED)


def test_node_declared_dead_while_alive_comes_back() -> None:
    sim = converged_sim(6, seed=10)
    victim = sim.nodes[4]
    inc = incarnation(victim, victim.node_id) or 0
    sim.inject(0, 1, Gossip(updates=[MemberUpdate(victim.node_id, Status.DEAD, inc)], records=[]))
    took = sim.wait_for(lambda: sim.all_see(4, (Status.ALIVE,)), timeout_s=5.0, step_s=0.01)
    assert took <= 2.0
    assert any(e.node_id == victim.node_id for _, e in sim.events_of(EventKind.ALIVE_AGAIN))


@pytest.mark.parametrize("seed", range(6))
def test_a_node_frozen_past_its_death_verdict_rejoins_a_peer_with_no_relay(seed: int) -> None:
    # Two members (no relay for indirect probes). One freezes (SIGSTOP, a closed lid) until
    # the other declares it dead. Woken, it sends what its timers had due on lanes the other
    # closed meanwhile (lost), then those lanes die of its silence. Its own lane-death probe
    # pings the peer on a fresh lane, so each hears from the other: the woken one learns it
    # was declared dead and refutes, and the peer stays alive in its view. (Without that ping,
    # whether anything reached the peer before the lane-death verdict was down to where the
    # probe round-robin stood: mostly not, and then neither ever spoke to the other again.)
    sim = converged_sim(2, seed=seed)
    sim.run_for(5.0 + seed * 0.13)  # the freeze lands at another point of the probe cycle
    sim.freeze(1)
    assert sim.wait_for(lambda: sim.status_seen(0, 1) is Status.DEAD, 10.0) < math.inf
    sim.run_for(1.0)
    sim.thaw(1)
    took = sim.wait_for(sim.converged, timeout_s=30.0, step_s=0.01)
    assert took <= sim.config.lane_dead_probe_s, took
    assert sim.nodes[1].m.stats.refutations == 1
    sim.run_for(10.0)
    assert sim.converged()


def test_restarted_node_rejoins_and_outranks_its_previous_life() -> None:
    sim = converged_sim(6, seed=11)
    sim.run_for(3.0)
    old_version = sim.nodes[0].m.view()[sim.nodes[2].node_id].capacity
    assert old_version is not None
    sim.kill(2)
    assert sim.wait_for(lambda: sim.all_see(2, (Status.DEAD,)), timeout_s=10.0) < math.inf
    sim.start(2, capacity=LocalCapacity(memory_budget_bytes=123))  # fresh state: incarnation 0
    sim.join(2, 0)
    took = sim.wait_for(
        lambda: (
            sim.converged()
            and all(
                (c := n.m.view()[sim.nodes[2].node_id].capacity) is not None
                and c.memory_budget_bytes == 123
                for n in sim.nodes
                if n.index != 2
            )
        ),
        timeout_s=5.0,
    )
    assert took <= 2.0
    assert (incarnation(sim.nodes[2], sim.nodes[2].node_id) or 0) > 0


def test_graceful_leave_is_known_everywhere_and_is_not_a_death() -> None:
    sim = converged_sim(8, seed=12)
    sim.leave(7)
    took = sim.wait_for(lambda: sim.all_see(7, (Status.LEFT,)), timeout_s=5.0, step_s=0.01)
    assert took <= 1.0
    sim.run_for(2.0)
    sim.kill(7)
    sim.run_for(10.0)
    assert not sim.events_of(EventKind.DIED)
    assert sim.all_see(7, (Status.LEFT,))


def test_dead_members_are_forgotten_after_retention() -> None:
    config = MembershipConfig(dead_retention_s=5.0)
    sim = Sim(5, seed=13, config=config)
    sim.start_all()
    assert sim.wait_for(sim.converged, timeout_s=5.0) < math.inf
    sim.kill(1)
    assert sim.wait_for(lambda: sim.all_see(1, (Status.DEAD,)), timeout_s=10.0) < math.inf
    sim.run_for(30.0)
    assert all(sim.status_seen(n.index, 1) is None for n in sim.up_nodes())


# ---- capacity records --------------------------------------------------------------------


def test_capacity_update_propagates_and_rtt_matrix_fills() -> None:
    sim = converged_sim(10, seed=14)
    sim.run_for(30.0)  # probes have measured round trips; rate limits have passed
    held = (ModelHolding("llama-tiny@abc", 0, 16, True, 42_000),)
    cap = LocalCapacity(memory_budget_bytes=8 << 30, models=held, sessions=2, queue=1)
    sim.nodes[4].m.set_capacity(cap, sim.now)

    def everyone_has_it() -> bool:
        for node in sim.nodes:
            record = node.m.view()[sim.nodes[4].node_id].capacity
            if record is None or record.memory_budget_bytes != 8 << 30:
                return False
        return True

    took = sim.wait_for(everyone_has_it, timeout_s=10.0, step_s=0.01)
    print(f"\ncapacity change known everywhere after {took:.2f} s")
    assert took <= 1.5
    record = sim.nodes[9].m.view()[sim.nodes[4].node_id].capacity
    assert record is not None and list(record.models) == list(held)
    assert record.sessions == 2 and record.queue == 1
    matrix = sim.nodes[0].m.rtt_matrix()
    pairs = {(a, b) for a, b in matrix if a != b}
    assert len(pairs) >= 10 * 9 // 2  # most of the pairwise matrix, from every member's row
    assert all(0.0 < rtt < 0.05 for rtt in matrix.values())  # sim RTT is 4..8 ms


def test_every_node_plans_from_the_same_rtt_matrix() -> None:
    # Plans come out the same on every node only if their inputs do: a node's own RTT row is
    # the one its signed record publishes (what every other node reads), never its live
    # measurements, which drift from the published row by up to the re-signing threshold.
    sim = converged_sim(4, seed=3)
    sim.run_for(30.0)  # probes have measured round trips; rate limits have passed

    def same_everywhere() -> bool:
        matrices = [node.m.rtt_matrix() for node in sim.nodes]
        return all(m == matrices[0] for m in matrices)

    took = sim.wait_for(same_everywhere, timeout_s=10.0, step_s=0.05)
    assert took < math.inf, "the nodes' RTT matrices never agreed"
    matrix = sim.nodes[0].m.rtt_matrix()
    assert len({(a, b) for a, b in matrix if a != b}) >= 4 * 3 // 2
    # And they stay the same while measurements drift below the threshold.
    agreed = 0
    for _ in range(40):
        sim.run_for(0.25)
        agreed += same_everywhere()
    assert agreed >= 30, f"the RTT matrices agreed in {agreed} of 40 polls"


def _forge(sim: Sim, owner: int, key: SigningKey, **changes: int) -> SignedRecord:
    current = sim.nodes[owner].m.view()[sim.nodes[owner].node_id].capacity
    assert current is not None
    forged = msgspec.structs.replace(current, version=current.version + 5, **changes)
    return sign_record(forged, signer(key))


def test_forged_capacity_record_is_rejected_and_counted() -> None:
    sim = converged_sim(6, seed=15)
    victim, liar, observer = 2, 5, 1
    genuine = sim.nodes[observer].m.view()[sim.nodes[victim].node_id].capacity
    # Signed by the wrong key.
    wrong_key = _forge(sim, victim, sim.nodes[liar].key, memory_budget_bytes=1 << 40)
    # The right signature over a different body.
    honest = _forge(sim, victim, sim.nodes[victim].key, memory_budget_bytes=1)
    tampered_body = msgspec.msgpack.encode(
        msgspec.structs.replace(read_record(honest), memory_budget_bytes=1 << 40)
    )
    tampered = SignedRecord(body=tampered_body, signature=honest.signature)
    sim.inject(observer, liar, Gossip(updates=[], records=[wrong_key, tampered]))
    assert sim.nodes[observer].m.stats.bad_signatures == 2
    assert sim.nodes[observer].m.view()[sim.nodes[victim].node_id].capacity == genuine
    # A genuine newer record from the same relay is accepted.
    sim.inject(observer, liar, Gossip(updates=[], records=[honest]))
    accepted = sim.nodes[observer].m.view()[sim.nodes[victim].node_id].capacity
    assert accepted is not None and accepted.memory_budget_bytes == 1


def test_unsigned_claims_cannot_pin_the_own_record_version() -> None:
    sim = converged_sim(4, seed=18)
    me = sim.nodes[1]
    lie = MemberUpdate(me.node_id, Status.ALIVE, 0, (1 << 63) - 1)
    sim.inject(1, 2, Gossip(updates=[lie], records=[]))
    sim.run_for(5.0)
    me.m.set_capacity(LocalCapacity(memory_budget_bytes=77), sim.now)

    def everyone_sees_it() -> bool:
        for node in sim.nodes:
            record = node.m.view()[me.node_id].capacity
            if record is None or record.memory_budget_bytes != 77:
                return False
        return True

    assert sim.wait_for(everyone_sees_it, timeout_s=5.0) <= 2.0
    own = me.m.view()[me.node_id].capacity
    assert own is not None and own.version < 1000


def test_an_urgent_capacity_change_goes_out_past_the_rate_limit() -> None:
    # A stopping node's "no model" must go out at once (the spare takes its stage); an
    # ordinary change waits for the record's rate limit.
    sim = converged_sim(8, seed=21)
    me = sim.nodes[1]
    interval = me.m.config.capacity_interval_s(len(sim.nodes))

    def signed(budget: int) -> Callable[[], bool]:
        def check() -> bool:
            record = me.m.view()[me.node_id].capacity
            return record is not None and record.memory_budget_bytes == budget

        return check

    def everyone_sees(budget: int) -> Callable[[], bool]:
        def check() -> bool:
            records = [node.m.view()[me.node_id].capacity for node in sim.nodes]
            return all(r is not None and r.memory_budget_bytes == budget for r in records)

        return check

    me.m.set_capacity(LocalCapacity(memory_budget_bytes=11), sim.now)
    assert sim.wait_for(signed(11), timeout_s=5.0) < math.inf
    me.m.set_capacity(LocalCapacity(memory_budget_bytes=12), sim.now)  # just re-signed
    assert sim.wait_for(signed(12), timeout_s=5.0) >= interval
    me.m.set_capacity(LocalCapacity(memory_budget_bytes=13), sim.now, urgent=True)
    assert sim.wait_for(signed(13), timeout_s=5.0) <= me.m.config.probe_interval_s
    assert sim.wait_for(everyone_sees(13), timeout_s=10.0) < math.inf


# ---- bounds ------------------------------------------------------------------------------


def _keyed(i: int) -> tuple[bytes, SigningKey]:
    key = SigningKey(i.to_bytes(32, "big"))
    return bytes(key.verify_key), key


def _member(i: int, **kw: object) -> Membership:
    node_id, key = _keyed(i)
    return Membership(
        node_id,
        address=f"10.0.0.{i}:7391",
        sign=lambda d: key.sign(d).signature,
        verify=verify_ed25519,
        now=0.0,
        **kw,  # type: ignore[arg-type]
    )


def test_view_is_bounded() -> None:
    m = _member(1, config=MembershipConfig(max_members=5))
    strangers = [MemberUpdate(_keyed(100 + i)[0], Status.ALIVE, 0) for i in range(20)]
    m.on_message(_keyed(2)[0], Gossip(updates=strangers, records=[]), 1.0)
    assert len(m.statuses()) == 1 + 5
    assert m.stats.members_refused == 15


def test_answers_to_a_flood_of_stale_accusations_fit_the_size_limit() -> None:
    m = _member(1)
    ids = [_keyed(300 + i)[0] for i in range(1000)]
    suspected = [MemberUpdate(i, Status.SUSPECT, 5, 0, _keyed(2)[0]) for i in ids]
    m.on_message(_keyed(2)[0], Gossip(suspected, []), 0.0)
    m.outgoing(0.0)
    stale = [MemberUpdate(i, Status.DEAD, 4) for i in ids]  # 76-byte suspicions answer these
    m.on_message(_keyed(3)[0], Gossip(stale, []), 0.1)
    out = m.outgoing(0.1)
    corrected = [u for _, msg in out if isinstance(msg, Gossip) for u in msg.updates]
    assert len(corrected) == 1000 and all(u.incarnation == 5 for u in corrected)
    assert all(len(encode(msg)) <= MAX_GOSSIP_BYTES for _, msg in out)


def test_large_view_syncs_in_pages_under_the_size_limit() -> None:
    big = _member(0)
    n = 1500
    records = []
    for i in range(1, n + 1):
        node_id, key = _keyed(1000 + i)
        cap = CapacityRecord(node_id, 1, f"10.1.{i // 256}.{i % 256}:7391", 1 << 33, [], 0, 0, [])
        records.append(sign_record(cap, signer(key)))
        big.on_message(
            node_id, Gossip(updates=[MemberUpdate(node_id, Status.ALIVE, 0)], records=[]), 0.0
        )
    for start in range(0, n, 64):
        big.on_message(
            _keyed(1001)[0], Gossip(updates=[], records=records[start : start + 64]), 0.0
        )
    assert sum(1 for i in big.view().values() if i.capacity is not None) == n + 1
    big.outgoing(0.0)
    joiner = _member(5)
    joiner.join(big.node_id, 1.0)
    pages = 0
    for _ in range(200):  # pump the two until quiet
        moved = False
        for src, dst in ((joiner, big), (big, joiner)):
            for peer, msg in src.outgoing(1.0):
                assert len(encode(msg)) <= MAX_GOSSIP_BYTES
                if peer == dst.node_id:
                    pages += isinstance(msg, SyncReply)
                    dst.on_message(src.node_id, decode(encode(msg)), 1.0)
                    moved = True
        if not moved:
            break
    seen = joiner.view()
    assert len(seen) == n + 2
    assert sum(1 for i in seen.values() if i.capacity is not None) == n + 2
    assert pages >= 6  # 1500 members need several pages
    print(f"\njoin against a {n}-member view took {pages} sync pages")


def test_broadcast_queue_sends_each_change_a_bounded_number_of_times() -> None:
    q = BroadcastQueue()
    for i in range(10):
        q.push(bytes([i]))
    sent: dict[bytes, int] = {}
    for _ in range(100):
        for item in q.take(4, transmit_limit=3):
            sent[item] = sent.get(item, 0) + 1
    assert sent == {bytes([i]): 3 for i in range(10)}
    assert len(q) == 0
    q.push(b"a")
    q.take(1, 3)
    q.push(b"b")
    assert q.take(1, 3) == [b"b"]  # least-sent first


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="probe_timeout_s"):
        MembershipConfig(probe_interval_s=0.5, probe_timeout_s=0.5)
    with pytest.raises(ValueError, match="gossip_interval_s"):
        MembershipConfig(gossip_interval_s=-1.0)
    assert MembershipConfig().retransmit_limit(1000) == 4 * 4


# ---- garbage -----------------------------------------------------------------------------


@functools.cache
def _genuine_messages() -> list[bytes]:
    """Every kind of message, as a short simulated run really sent them (captured once)."""
    sim = converged_sim(4, seed=16)
    captured: list[bytes] = []
    original = sim._route

    def capture(src, dst_index, data):  # type: ignore[no-untyped-def]
        captured.append(data)
        original(src, dst_index, data)

    sim._route = capture  # type: ignore[method-assign]
    sim.nodes[1].m.set_capacity(LocalCapacity(memory_budget_bytes=5), sim.now)
    sim.kill(3)
    sim.run_for(12.0)
    kinds = {type(decode(d)) for d in captured}
    assert {Ping, Ack, Gossip, Want, SyncDigest, SyncReply, PingReq} <= kinds
    return captured


@given(st.binary(max_size=4096))
@settings(max_examples=400)
def test_decoder_raises_only_remote_protocol_error_on_garbage(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode(data)


@given(
    st.integers(0, 1 << 16),
    st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 4096),
)
@settings(max_examples=400)
def test_mutated_genuine_messages_never_crash_decoder_or_state_machine(
    pick: int, flips: list[tuple[int, int]], cut: int
) -> None:
    genuine = _genuine_messages()
    mutated = bytearray(genuine[pick % len(genuine)])
    for pos, value in flips:
        if mutated:
            mutated[pos % len(mutated)] = value
    mutated = mutated[: max(1, len(mutated) - cut % 8)]
    try:
        message = decode(bytes(mutated))
    except RemoteProtocolError:
        return
    m = _member(50)
    m.on_message(_keyed(51)[0], message, 1.0)
    m.tick(2.0)
    m.outgoing(2.0)
    assert m.statuses()[m.node_id] is Status.ALIVE


_IDS = [_keyed(60 + i)[0] for i in range(4)]
_updates = st.builds(
    MemberUpdate,
    st.sampled_from(_IDS),
    st.sampled_from(list(Status)),
    st.integers(0, (1 << 63) - 1) | st.integers(0, 3),
    st.integers(0, (1 << 63) - 1) | st.integers(0, 3),
    st.none() | st.sampled_from(_IDS),
)
_messages = st.one_of(
    st.builds(Ping, st.integers(0, 50), st.lists(_updates, max_size=4)),
    st.builds(Ack, st.integers(0, 50), st.lists(_updates, max_size=4)),
    st.builds(PingReq, st.integers(0, 50), st.sampled_from(_IDS), st.lists(_updates, max_size=4)),
    st.builds(Gossip, st.lists(_updates, max_size=4), st.just([])),
    st.builds(Want, st.lists(st.sampled_from(_IDS), max_size=4)),
    st.builds(SyncDigest, st.just(b""), st.just(b""), st.lists(_updates, max_size=4)),
    st.builds(
        SyncReply,
        st.just(b""),
        st.just(b""),
        st.lists(_updates, max_size=4),
        st.just([]),
        st.lists(st.sampled_from(_IDS), max_size=4),
        st.sampled_from([b"", _IDS[0]]),
    ),
)


@given(st.lists(st.tuples(st.sampled_from(_IDS[1:]), _messages, st.floats(0.0, 3.0)), max_size=25))
@settings(max_examples=150)
def test_any_sequence_of_wellformed_lies_keeps_the_state_machine_sane(
    script: list[tuple[bytes, object, float]],
) -> None:
    m = _member(60)  # _IDS[0] is this node: the lies are partly about itself
    now = 0.0
    for sender, message, dt in script:
        now += dt
        m.on_message(sender, message, now)  # type: ignore[arg-type]
        m.tick(now)
        for _, out in m.outgoing(now):
            assert len(encode(out)) <= MAX_GOSSIP_BYTES
        deadline = m.next_deadline()
        assert deadline is None or deadline > now  # after a tick nothing is overdue
        assert m.statuses()[m.node_id] is Status.ALIVE  # it refutes, never believes its death
    assert len(m.statuses()) <= 4


# ---- bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "window_s"), [(10, 60.0), (100, 30.0)])
def test_gossip_bytes_per_node_per_second(n: int, window_s: float) -> None:
    load = measure_gossip_load(n, window_s=window_s, churn=True)
    print(
        f"\nN={n}: {load.bytes_per_node_s:.0f} B/s and {load.messages_per_node_s:.1f} messages/s "
        f"per node over {window_s:.0f} s, {load.records_published} records re-signed "
        "(every node's load changing every second, 1% loss)"
    )
    assert load.bytes_per_node_s < 10_000
