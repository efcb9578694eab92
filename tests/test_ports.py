"""Ports the tests and the engine launchers pick: free when picked, and out of the kernel's
ephemeral range, where any process on the machine (a Ray starting beside) may take one first."""

import socket

import pytest

from actors.ports import QUIET_LOW, ephemeral_range, free_port

pytestmark = pytest.mark.ray_free


def test_a_picked_port_is_free_and_outside_the_range_the_kernel_hands_out():
    lo, _ = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(QUIET_LOW <= p < lo for p in ports), sorted(ports)
    assert len(ports) > 1  # random: two runs side by side pick differently
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_under_a_bound_stays_under_it():
    assert all(free_port(below=QUIET_LOW + 2000) < QUIET_LOW + 2000 for _ in range(20))
    assert free_port(below=5000) < 5000
