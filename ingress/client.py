"""`RolloutClient`: a worker's side of the ingress — spec, weights, leases, submissions.

One REQ socket, CURVE-encrypted with the controller's public key. A request that gets no answer
within `timeout_s` is sent again on a fresh socket (a REQ socket that lost its reply is stuck),
so a network cut or a controller restart costs a retry, not the worker. Requests are safe to
repeat: a repeated lease request leaves unused leases to expire, a repeated submission is
answered `duplicate`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import torch
import zmq
from safetensors.torch import load as load_safetensors

from meshrl.ingress.keys import load_pair, load_public
from meshrl.ingress.protocol import Context, Episode, GroupResult, Lease, Reply, Spec, Verdict
from meshrl.models.routing import encode_record
from meshrl.rollouts.episodes import Rollout, Segment

AUTH_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class IngressError(RuntimeError):
    """The controller answered with an error, refused this key, or did not answer."""


class Refused(IngressError):
    """The controller refuses this key: not authorized, or banned for the run (final)."""


class NoAnswer(IngressError):
    """No reply within the retries: the controller is down or unreachable (a worker waits and retries)."""


class Cancelled(IngressError):
    """The client's `stop` event was set while it waited for a reply (a worker told to stop)."""


def to_context(segment: Segment) -> Context:
    return Context(token_ids=segment.token_ids, loss_mask=segment.loss_mask, logprobs=segment.logprobs,
                   routing=encode_record(segment.routing))  # fmt: skip


def to_episode(rollout: Rollout) -> Episode:
    return Episode(
        **vars(to_context(rollout.segments()[-1])),
        versions=rollout.versions, messages=rollout.messages, finish_reason=rollout.finish_reason,
        reward=float(rollout.reward if rollout.reward is not None else 0.0),
        earlier=[to_context(segment) for segment in rollout.earlier], elided=sorted(rollout.elided),
    )  # fmt: skip


class RolloutClient:
    def __init__(
        self,
        connect: str,
        server_key: str | Path | None,
        key: str | Path | None,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`: when set, a request waiting for its reply raises `Cancelled` at once. No keys
        (None, None) means plain TCP: only the benchmark's baseline server (`curve=False`) accepts it."""
        self.connect = connect
        self.curve = server_key is not None
        self.server_public = load_public(server_key) if self.curve else b""
        self.public, self.secret = load_pair(key) if self.curve else (b"", b"")
        self.timeout_s, self.retries = timeout_s, retries
        self.stop = stop or threading.Event()
        self.epoch: str | None = None  # the controller's, from the last reply
        self.version: int | None = None  # the newest policy version, from the last reply
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None

    # ------------------------------------------------------------------ requests

    def spec(self) -> Spec:
        reply, _ = self.request({"op": "spec"})
        assert reply.spec is not None
        return reply.spec

    def lease(self, n: int) -> list[Lease]:
        """Up to n groups to sample (fewer, or none, when the controller has none to hand out)."""
        reply, _ = self.request({"op": "lease", "n": n})
        return reply.leases

    def submit(self, results: list[GroupResult]) -> list[Verdict]:
        """Submit finished groups; the controller verifies them before it answers."""
        payload = {"op": "submit", "groups": [r.model_dump() for r in results]}
        reply, _ = self.request(payload)
        return reply.verdicts

    def weights(self, version: int | None = None, base: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """A policy version's weights (default: the newest), fetched in chunks and checked against
        the version's sha256; a download cut off resumes at the byte it reached. `base`: the base
        model a LoRA run's versions (adapters) apply to, returned as version 0."""
        if base:
            version = 0
        elif version is None:
            version = self.request({"op": "lease", "n": 0})[0].version
            if version < 0:
                raise IngressError(f"{self.connect} has not published a policy version yet")
        data = bytearray()
        size, digest = None, ""
        while size is None or len(data) < size:
            reply, chunk = self.request({"op": "weights", "version": version, "offset": len(data), "base": base})
            info = reply.chunk
            assert info is not None and chunk is not None
            if size is not None and (info.size, info.sha256) != (size, digest):
                data.clear()  # the controller restarted and republished this version: start over
            size, digest = info.size, info.sha256
            if info.offset != len(data) or len(data) + len(chunk) > size or not chunk:
                raise IngressError(
                    f"weights of version {version}: chunk at {info.offset} does not continue {len(data)}"
                )
            data += chunk
        if hashlib.sha256(data).hexdigest() != digest:
            raise IngressError(f"weights of {'the base model' if base else f'version {version}'}: sha256 mismatch")
        return version, load_safetensors(bytes(data))

    def request(self, payload: dict, timeout_s: float | None = None) -> tuple[Reply, bytes | None]:
        """Send one request and return the reply (and a weight chunk's bytes), retrying on a fresh
        socket when no answer comes; raises IngressError on an error reply or a refused key."""
        message = json.dumps(payload).encode()
        for _ in range(self.retries + 1):
            socket = self._open()
            socket.send(message)
            if self._wait(socket, timeout_s or self.timeout_s):
                frames = socket.recv_multipart()
                reply = Reply.model_validate_json(frames[0])
                self.epoch, self.version = reply.epoch, reply.version
                if reply.error:
                    raise (Refused if reply.refused else IngressError)(f"{self.connect}: {reply.error}")
                return reply, frames[1] if len(frames) > 1 else None
            self._close()  # the REQ socket waits for a reply that will not come
        raise NoAnswer(
            f"no answer from {self.connect} after {self.retries + 1} tries of {timeout_s or self.timeout_s:.0f} s"
        )

    # ------------------------------------------------------------------ the socket

    def _open(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.REQ)
            socket.linger = 0
            if self.curve:
                socket.curve_secretkey, socket.curve_publickey = self.secret, self.public
                socket.curve_serverkey = self.server_public
            self._monitor = socket.get_monitor_socket(AUTH_FAILED)
            socket.connect(self.connect)
            self._socket = socket
        self._check_refused()
        return self._socket

    def _wait(self, socket: zmq.Socket, timeout_s: float) -> bool:
        """Whether a reply came within `timeout_s`; a refused handshake raises at once."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.stop.is_set():
                self._close()
                raise Cancelled(f"stopped while waiting for {self.connect}")
            ready = dict(poller.poll(min(int(left * 1000) + 1, 200)))
            if socket in ready:
                return True
            if self._monitor in ready:
                self._check_refused()
        return False

    def _check_refused(self) -> None:
        """A CURVE handshake the controller refused (unknown or banned key) surfaces as a monitor event."""
        if self._monitor is not None and self._monitor.poll(0):
            self._close()
            raise Refused(
                f"{self.connect} refused this worker's key {self.public.decode()} "
                "(not in ingress.authorized_keys, or banned for this run)"
            )

    def _close(self) -> None:
        for sock in (self._monitor, self._socket):
            if sock is not None:
                sock.close(linger=0)
        self._socket = self._monitor = None

    def close(self) -> None:
        self._close()
        self._context.destroy(linger=0)  # any socket left open is closed first: term() would wait on it forever

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
