"""Attach mode's handshake (megarl/executors/attach.py) against peers that connect and then say
nothing (a port scanner, a health probe, a rank whose node hung right after connecting): the
controller's wait and a rank's connect both stay within their timeouts. Real sockets on loopback,
threads for the peers; each call under test runs in a thread joined with a timeout, so a hang fails
the test instead of hanging the suite."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import threading
import time

import pytest

from megarl.executors import attach
from megarl.executors.attach import AttachError, AttachSpec, accept_ranks, connect
from megarl.utils.dist import free_tcp_port

SLACK_S = 3.0  # thread start, the accept poll (0.5 s) and a loaded 2-core machine


def _within(fn, limit_s: float):
    """``fn()``'s result (or its exception, raised here) and the seconds it took; fails the test if it
    is still running after ``limit_s`` (the thread is a daemon: it cannot hold the suite)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    took = time.monotonic() - start
    if t.is_alive():
        pytest.fail(f"still blocked after {limit_s:.1f}s")
    if "error" in out:
        raise out["error"]
    return out["value"], took


def _silent_peer(port: int, limit_s: float = 10.0) -> socket.socket:
    """A TCP connection to ``port`` (retried while the listener starts) that will never send a byte."""
    give_up = time.monotonic() + limit_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1.0)
        except ConnectionRefusedError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.02)


def _rank(spec: AttachSpec, rank: int, timeout_s: float, attached: list) -> None:
    """What a rank does (join_controller, less its SIGTERM handler, which only a main thread may set)."""
    conn = connect("127.0.0.1", spec.port, spec.authkey, timeout_s)
    conn.send(("hello", {"rank": rank, "host": "h", "pid": 100 + rank, "job": spec.job_id}))
    attached.append(conn)


def _unbounded(conn) -> bool:
    """Whether ``conn``'s reads and writes wait without a bound (SO_RCVTIMEO / SO_SNDTIMEO cleared)."""
    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        size = struct.calcsize("ll")
        return (s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, size) == bytes(size)
                and s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, size) == bytes(size))
    finally:
        s.close()


def test_a_silent_peer_does_not_keep_the_ranks_out(monkeypatch, caplog):
    """The silent peer is accepted first; it is refused after the handshake bound (2 s here) and
    the two ranks queued behind it attach, long before the 30 s timeout (unbounded, the wait would
    never end: the challenge's read has no timeout). The bound also applies to the real ranks' own
    handshakes: 2 s leaves a starved rank thread room on a loaded machine (0.5 s did not)."""
    handshake_s, timeout_s = 2.0, 30.0
    monkeypatch.setattr(attach, "_HANDSHAKE_S", handshake_s)
    spec = AttachSpec(free_tcp_port(), b"right-key", job_id="7")
    attached: list = []
    silent = None

    def peers() -> None:
        nonlocal silent
        silent = _silent_peer(spec.port)
        for r in (0, 1):  # behind the silent peer in the listen backlog
            threading.Thread(target=_rank, args=(spec, r, timeout_s, attached), daemon=True).start()

    threading.Thread(target=peers, daemon=True).start()
    caplog.set_level(logging.WARNING, logger=attach.__name__)
    try:
        got, took = _within(lambda: accept_ranks(spec, 2, timeout_s), timeout_s + SLACK_S)
        assert [h["rank"] for _, h in got] == [0, 1]
        assert took < handshake_s + SLACK_S < timeout_s, took
        assert silent is not None
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refused) == 1 and str(silent.getsockname()[1]) in refused[0], refused
        assert "did not authenticate and say hello within 2.0s" in refused[0]
        # The handshake's bound is gone once the ranks are in: the protocol's reads wait as long as it lives
        deadline = time.monotonic() + SLACK_S
        while len(attached) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(_unbounded(c) for c, _ in got) and len(attached) == 2 and all(_unbounded(c) for c in attached)
    finally:
        for c in attached:
            c.close()
        if silent is not None:
            silent.close()


def test_a_silent_peer_alone_ends_in_the_timeout_error():
    """Only a silent peer comes: the wait ends in the timeout error naming the missing rank, within
    its 2 s (the handshake is bounded by the time left to the deadline, not the 30 s bound)."""
    timeout_s = 2.0
    spec = AttachSpec(free_tcp_port(), b"right-key")
    silent: list = []
    threading.Thread(target=lambda: silent.append(_silent_peer(spec.port)), daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(AttachError, match=r"rank\(s\) \[0\] of 1 did not attach within 2s"):
            _within(lambda: accept_ranks(spec, 1, timeout_s), timeout_s + attach._HANDSHAKE_S + SLACK_S)
        took = time.monotonic() - start
        assert took < timeout_s + SLACK_S, took
        assert silent, "the silent peer never connected"
    finally:
        for s in silent:
            s.close()


def test_a_rank_facing_a_silent_listener_names_the_address_and_the_knob():
    """A listener that accepts and never speaks (not the controller, or a hung one): the rank's
    connect gives up within its 1.5 s, naming the address and the knob, instead of waiting forever
    in the challenge."""
    timeout_s = 1.5
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(AttachError) as err:
            _within(lambda: connect("127.0.0.1", port, b"key", timeout_s, timeout_knob="trainer.start_timeout_s"),
                    timeout_s + SLACK_S)
        took = time.monotonic() - start
        msg = str(err.value)
        assert f"127.0.0.1:{port}" in msg and "(trainer.start_timeout_s)" in msg, msg
        assert "did not complete the authentication handshake" in msg, msg
        assert took < timeout_s + SLACK_S, took
        assert accepted, "the listener never accepted"
    finally:
        for s in accepted:
            s.close()
        srv.close()
