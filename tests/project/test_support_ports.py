"""The ports the tests give their own servers are never ones the kernel hands to client sockets."""

from __future__ import annotations

import socket

from tests.support.ports import ephemeral_range, free_port, free_ports


def test_a_server_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, _ = ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(10000 <= port < low for port in ports)
    for port in [*ports, free_port()]:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_a_paired_port_leaves_its_partner_below_the_range_and_free() -> None:
    low, _ = ephemeral_range()
    for port in free_ports(3, paired_offset=10000):
        assert port + 10000 < low
        with socket.create_server(("127.0.0.1", port + 10000)):
            pass


def test_a_port_in_use_is_never_given() -> None:
    taken = [socket.create_server(("127.0.0.1", port)) for port in free_ports(50)]
    try:
        busy = {sock.getsockname()[1] for sock in taken}
        assert not busy & set(free_ports(200))
    finally:
        for sock in taken:
            sock.close()
