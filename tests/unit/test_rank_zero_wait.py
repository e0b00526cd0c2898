"""``commands.wait_for_rank_zero``: a rank other than 0 joins the process group once rank 0's store listens, instead of
backing off for half a second in torch's store client; it never waits for an address that cannot answer."""

import socket
import threading
import time

from shardlab.ranks.commands import free_port, wait_for_rank_zero


def test_a_rank_waits_for_rank_zeros_port_and_goes_on_as_soon_as_it_listens(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening_at = []

    def rank_zero():
        time.sleep(0.3)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listening_at.append(time.monotonic())

    threading.Thread(target=rank_zero, daemon=True).start()
    t0 = time.monotonic()
    try:
        wait_for_rank_zero(1, timeout_s=10)
        returned = time.monotonic()
    finally:
        listener.close()
    assert listening_at and returned >= listening_at[0] > t0 + 0.25  # it waited for the listener
    assert returned - listening_at[0] < 0.2  # and went on within a few polls


def test_rank_zero_an_unset_rendezvous_and_an_address_that_cannot_answer_are_not_waited_for(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    t0 = time.monotonic()
    wait_for_rank_zero(0, timeout_s=10)  # rank 0 is the one that listens
    monkeypatch.delenv("MASTER_ADDR")
    wait_for_rank_zero(1, timeout_s=10)  # no rendezvous to wait for
    monkeypatch.setenv("MASTER_ADDR", "fe80::1")  # link-local without an interface: refused by this host, not by rank 0
    wait_for_rank_zero(1, timeout_s=10)  # joining says what is wrong with the address
    assert time.monotonic() - t0 < 2


def test_a_rank_zero_that_never_listens_is_waited_for_at_most_the_timeout(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    t0 = time.monotonic()
    wait_for_rank_zero(1, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 1.5
