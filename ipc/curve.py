"""The encrypted, mutually authenticated channel of tcp:// edges: CurveZMQ, keyed by the secret.

Every process of a run holds the shared secret (`ipc.auth`). From it both ends derive the same
two Curve25519 key pairs, one for servers (a shard's or the draft's ROUTER) and one for clients
(every DEALER that connects to them), so no key is ever sent or configured by hand:

- the server proves it holds the secret by completing the CurveZMQ handshake with the server
  key the client expects (a peer without the secret cannot: the client's HELLO is sealed to that
  key), and the client proves it with the HMAC challenge of `ipc.peers` that follows, now inside
  the encrypted channel: both directions are authenticated;
- every message after the handshake is encrypted and authenticated (CurveZMQ boxes), so a byte
  changed on the wire fails to open and the connection drops: it is never read as data.

ipc:// edges (one host, sockets in a 0700 directory) stay plaintext; every tcp:// edge, loopback
included, uses this channel. A wrong secret shows as a peer that never answers (CurveZMQ drops a
handshake it cannot open without a reply), and the error names that cause.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
from zmq.utils import z85


def needs_curve(address: str) -> bool:
    return address.startswith("tcp://")


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys derived from the shared secret for one role."""
    sk = z85.encode(hmac.new(secret, b"layersplit curve " + label, hashlib.sha256).digest())
    return zmq.curve_public(sk), sk


def secure_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make a ROUTER about to bind a tcp:// address a CurveZMQ server (before `bind`)."""
    sock.curve_publickey, sock.curve_secretkey = _keypair(secret, b"server")
    sock.curve_server = True


def secure_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make a DEALER about to connect to a tcp:// address a CurveZMQ client (before `connect`)."""
    sock.curve_serverkey = _keypair(secret, b"server")[0]
    sock.curve_publickey, sock.curve_secretkey = _keypair(secret, b"client")
