"""Who may talk to a server process (a shard or the draft): the shared-secret handshake and the
message types each authenticated role may send.

A peer sends `hello{nonce, role}`, gets `challenge{nonce}`, and proves it holds the secret with
`auth{mac}` (`ipc.auth`); until then every other message is refused. Both server kinds keep one
`Gate` and ask it about every message they receive.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import zmq
from layersplit.ipc import auth
from layersplit.ipc.messages import ProtocolError, error, message
from layersplit.ipc.sockets import request

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Peer:
    role: str
    nonce: bytes
    client_nonce: bytes
    authed: bool = False


class Gate:
    def __init__(self, secret: bytes, allowed: dict[str, set[str]], name: str) -> None:
        self.secret, self.allowed, self.name = secret, allowed, name
        self.peers: dict[bytes, Peer] = {}

    def hello(self, route: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to a `hello`: a challenge, or an error for an unknown role."""
        role = msg["role"]
        if role not in self.allowed:
            return error(f"{self.name}: unknown role {role!r}", "bad_message", sid=msg.get("sid"))
        peer = Peer(role, auth.new_nonce(), msg["nonce"])
        self.peers[route] = peer
        return message("challenge", nonce=peer.nonce)

    def authenticate(self, route: bytes, msg: dict[str, Any]) -> Peer | None:
        """The peer, if its `auth` proves the secret; else it is forgotten and None returned."""
        peer = self.peers.get(route)
        if peer is None or not auth.verify(self.secret, peer.nonce, peer.client_nonce, peer.role,
                                           msg["mac"]):
            self.peers.pop(route, None)
            log.warning("%s: refused a peer that failed authentication", self.name)
            return None
        peer.authed = True
        return peer

    def screen(self, route: bytes, msg: dict[str, Any], reply) -> bool:
        """Whether a message goes on to its server's handler. A `hello` is answered here, and so
        is a message this peer may not send; `auth` goes on (the server's welcome says who it
        is), as does anything an authenticated peer may send."""
        if msg["type"] == "hello":
            reply(route, self.hello(route, msg))
            return False
        if msg["type"] == "auth":
            return True
        refusal = self.refusal(route, msg)
        if refusal is not None:
            reply(route, refusal)
            return False
        return True

    def refusal(self, route: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        """An error reply if this peer may not send this message, else None."""
        peer = self.peers.get(route)
        if peer is None or not peer.authed:
            return error(f"{self.name}: unauthenticated peer; send hello and auth with the shared "
                         "secret first", "unauthenticated", sid=msg.get("sid"))
        if msg["type"] not in self.allowed[peer.role]:
            return error(f"{self.name}: {peer.role} may not send {msg['type']!r}", "unexpected",
                         sid=msg.get("sid"))
        return None

    def role(self, route: bytes) -> str | None:
        peer = self.peers.get(route)
        return peer.role if peer is not None and peer.authed else None

    def keep_only(self, role: str) -> None:
        self.peers = {r: p for r, p in self.peers.items() if p.role == role}


AUTH_FAILED = "authentication failed: wrong shared secret"


def expect(reply: dict[str, Any], t: str, who: str) -> None:
    if reply.get("type") != t:
        detail = reply.get("message") if reply.get("type") == "error" else reply.get("type")
        raise ProtocolError(f"expected {t!r} from {who}, got: {detail}")


def handshake(sock: zmq.Socket, secret: bytes, role: str, timeout_s: float,
              who: str) -> dict[str, Any]:
    """Authenticate on a connected DEALER socket as `role`; returns the `welcome` reply."""
    nonce = auth.new_nonce()
    reply, _ = request(sock, message("hello", nonce=nonce, role=role), timeout_s)
    expect(reply, "challenge", who)
    reply, _ = request(sock, message("auth", mac=auth.mac(secret, reply["nonce"], nonce, role)),
                       timeout_s)
    expect(reply, "welcome", who)
    return reply
