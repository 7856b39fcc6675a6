import pytest

from meshd.net.emulator import LinkEmulator, LinkProfile


def run(profile: LinkProfile, n: int = 2000, spacing_s: float = 0.001) -> list[tuple[float, bytes]]:
    emu = LinkEmulator(profile)
    out: list[tuple[float, bytes]] = []
    t = 0.0
    for i in range(n):
        emu.submit(i.to_bytes(4, "big"), "peer", t)
        out += [(t, d) for d, _ in emu.due(t)]
        t += spacing_s
    while (deadline := emu.next_deadline()) is not None:
        out += [(deadline, d) for d, _ in emu.due(deadline)]
    return out


def test_ideal_link_delivers_everything_in_order_at_once() -> None:
    out = run(LinkProfile())
    assert [int.from_bytes(d, "big") for _, d in out] == list(range(2000))


def test_delay_is_applied_to_every_datagram() -> None:
    emu = LinkEmulator(LinkProfile(delay_s=0.02))
    emu.submit(b"x", "peer", 1.0)
    assert emu.due(1.019) == []
    assert emu.due(1.02) == [(b"x", "peer")]


@pytest.mark.parametrize("loss", [0.01, 0.05, 0.2])
def test_loss_rate_matches_profile_and_is_seeded(loss: float) -> None:
    a = run(LinkProfile(loss=loss, seed=7), n=5000)
    b = run(LinkProfile(loss=loss, seed=7), n=5000)
    assert a == b
    lost = 1 - len(a) / 5000
    assert abs(lost - loss) < 0.02


def test_duplication_and_reordering_happen() -> None:
    out = run(LinkProfile(duplicate=0.05, reorder=0.05, reorder_extra_s=0.005, seed=3))
    ids = [int.from_bytes(d, "big") for _, d in out]
    assert len(ids) > 2000  # duplicates
    assert ids != sorted(ids)  # overtaken
    assert set(ids) == set(range(2000))


def test_jitter_alone_keeps_fifo_order() -> None:
    out = run(LinkProfile(delay_s=0.01, jitter_s=0.02, seed=1))
    ids = [int.from_bytes(d, "big") for _, d in out]
    assert ids == list(range(2000))


def test_bandwidth_cap_serialises_datagrams() -> None:
    emu = LinkEmulator(LinkProfile(bandwidth_bytes_s=1000.0))
    for _ in range(10):
        emu.submit(b"x" * 100, "peer", 0.0)
    # 10 x 100 bytes at 1000 B/s: the last leaves after one second.
    assert len(emu.due(0.95)) == 9
    assert len(emu.due(1.0)) == 1


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="loss"):
        LinkProfile(loss=1.5)
    with pytest.raises(ValueError, match="delay_s"):
        LinkProfile(delay_s=-1)
