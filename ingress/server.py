"""The controller's ingress: a ROUTER socket serving rollout workers from its own thread.

Workers authenticate with CURVE keys (admitted: the public keys in `ingress.authorized_keys`,
re-read at each handshake, minus keys banned during the run). The controller offers some of
each step's groups; a worker leases them (each lease bound to its key, the group's oldest
allowed policy version and an expiry), samples them, and submits. A verifier thread checks
each submission (`ingress.verify`) before the worker gets its verdict; accepted groups wait in
`collect()` for the controller, rejected ones, expired leases and offers nobody took by the
time their step is gathered come back from `reclaim()` for the mesh's generators to run.

Worker input never reaches the controller's loop unchecked and never raises there: a request
that does not parse is `malformed`, a verification that fails in any way is a rejection.
"""

from __future__ import annotations

import base64
import hashlib
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from pydantic import TypeAdapter, ValidationError
from zmq.auth.thread import ThreadAuthenticator

from meshrl.configs.schema import IngressConfig
from meshrl.ingress.keys import load_pair, load_public
from meshrl.ingress.protocol import (
    GroupResult,
    Lease,
    LeaseRequest,
    Reply,
    Request,
    Spec,
    SpecRequest,
    SubmitRequest,
    Verdict,
    WeightsChunk,
    WeightsRequest,
)
from meshrl.ingress.verify import Rejected, Verifier
from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest

CHUNK_BYTES = 4 << 20
KEEP_STEPS = 64  # finished leases remembered this many steps (a replay of an older one is an unknown lease)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
REQUESTS = TypeAdapter(Request)


def model_files(model_dir: str | Path) -> dict[str, str]:
    """A model directory's files other than weights (config, tokenizer, chat template), base64."""
    files = {}
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.startswith("."):
            files[path.name] = base64.b64encode(path.read_bytes()).decode()
    return files


@dataclass
class LeaseRecord:
    """One offered group through its life: offered -> leased -> verifying -> accepted | rejected,
    or -> reclaimed (given to the mesh); `submitted` is the digest of the first submission."""

    lease_id: str
    group: GroupRequest
    step: int
    state: str = "offered"
    owner: str = ""
    leased_at: float = 0.0
    deadline: float = float("inf")
    submitted: str = ""


@dataclass
class Published:
    path: Path
    size: int
    sha256: str


def _published(path: Path) -> Published:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return Published(path, path.stat().st_size, digest.hexdigest())


@dataclass
class _Pending:
    """A submit request waiting for its verdicts; replied to once none is missing."""

    identity: bytes
    verdicts: list[Verdict | None]
    work: list[tuple[int, LeaseRecord, GroupResult]] = field(default_factory=list)


class IngressServer:
    def __init__(
        self,
        config: IngressConfig,
        spec: Spec,
        verifier: Verifier,
        *,
        curve: bool = True,
    ) -> None:
        """`curve=False` (plain TCP, every key admitted) exists for the benchmark's baseline only."""
        self.config, self.spec, self.verifier = config, spec, verifier
        self.epoch = secrets.token_hex(4)
        self.counts: Counter[str] = Counter()
        self.banned: set[str] = set()
        self.strikes: Counter[str] = Counter()
        self.workers: set[str] = set()
        self.version = -1  # none published yet
        self._lock = threading.Lock()
        self._records: dict[str, LeaseRecord] = {}
        self._by_key: dict[str, LeaseRecord] = {}  # group key -> its open record
        self._published: dict[int, Published] = {}
        self._base: Published | None = None  # LoRA runs: the base model the versions' adapters apply to
        self._accepted: list[FinishedGroup] = []
        self._verify_queue: queue.Queue[_Pending | None] = queue.Queue()
        self._done: queue.Queue[_Pending] = queue.Queue()
        self._closed = threading.Event()
        self._context = zmq.Context()
        self._auth = None
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        self._socket.maxmsgsize = int(config.max_message_mb * 2**20)
        if curve:
            public, secret = load_pair(config.server_key)
            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
            self._socket.curve_server = True
            self._socket.curve_publickey, self._socket.curve_secretkey = public, secret
        self.address = self._bind(config.bind)
        self._threads = [
            threading.Thread(target=self._serve, name="ingress", daemon=True),
            threading.Thread(target=self._verify_loop, name="ingress-verify", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _bind(self, address: str) -> str:
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            raise ValueError(f"ingress.bind {address!r}: {exc}") from None
        return self._socket.last_endpoint.decode()

    # ------------------------------------------------------------------ the controller's side

    def offer(self, step: int, groups: list[GroupRequest]) -> None:
        with self._lock:
            for group in groups:
                record = LeaseRecord(f"{self.epoch}-{secrets.token_urlsafe(12)}", group, step)
                self._records[record.lease_id] = record
                self._by_key[group.key] = record
                self.counts["offered"] += 1

    def reclaim(self, step: int) -> list[GroupRequest]:
        """Groups the mesh must run now: offers of steps up to `step` no worker leased, leases past
        their expiry (a later submission is `late`), rejected submissions."""
        now = time.monotonic()
        back = []
        with self._lock:
            for key, record in list(self._by_key.items()):
                unleased = record.state == "offered" and record.step <= step
                expired = record.state == "leased" and now > record.deadline
                if unleased or expired or record.state == "rejected":
                    self.counts["expired"] += expired
                    self.counts["reclaimed"] += 1
                    if record.state != "rejected":
                        record.state = "reclaimed"
                    del self._by_key[key]
                    back.append(record.group)
            for lease_id, record in list(self._records.items()):  # oldest first; open ones stay
                if record.step >= step - KEEP_STEPS or record.group.key in self._by_key:
                    break
                del self._records[lease_id]
        return back

    def collect(self) -> list[FinishedGroup]:
        with self._lock:
            accepted, self._accepted = self._accepted, []
        return accepted

    def publish(self, version: int, path: Path) -> None:
        """Serve policy `version` from `path` (a safetensors file the controller owns); versions no
        open lease may still sample with are dropped, and their files removed."""
        published = _published(path)
        with self._lock:
            self._published[version] = published
            self.version = version
            open_versions = [r.group.min_version for r in self._by_key.values()]
            oldest = min([version, *open_versions])
            for old in [v for v in self._published if v < oldest]:
                self._published.pop(old).path.unlink(missing_ok=True)

    def publish_base(self, path: Path) -> None:
        """Serve the base model from `path` (LoRA runs, once: every version's file is adapters)."""
        self._base = _published(path)

    def weights_path(self, version: int) -> Path | None:
        with self._lock:
            published = self._published.get(version)
        return published.path if published else None

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = dict(self.counts)
            return {
                **{f"ingress/{k}": float(v) for k, v in sorted(counts.items())},
                "ingress/workers": float(len(self.workers)),
                "ingress/banned_keys": float(len(self.banned)),
                "ingress/verify_s": self.verifier.stats.seconds,
                "ingress/verified_tokens": float(self.verifier.stats.checked_tokens),
            }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the counters and the keys banned for the run."""
        with self._lock:
            return {"counts": dict(self.counts), "banned": sorted(self.banned)}

    def restore(self, state: dict[str, Any]) -> None:
        """Counters and bans from a checkpoint's `state()` (a resumed run keeps both)."""
        with self._lock:
            self.counts = Counter(state.get("counts", {}))
            self.banned = set(state.get("banned", []))

    def close(self) -> None:
        self._closed.set()
        self._verify_queue.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.destroy(linger=0)  # any socket left open is closed first: term() would wait on it forever
        for published in [*self._published.values(), *([self._base] if self._base else [])]:
            published.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ admission (the authenticator's thread)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: admit a CURVE key listed in authorized_keys (re-read, so keys can be added while
        the run goes on) and not banned."""
        name = key.decode()
        folder = Path(self.config.authorized_keys)
        listed = any(_public_or_none(p) == key for p in folder.glob("*.key")) if folder.is_dir() else False
        allowed = listed and name not in self.banned
        if not allowed:
            with self._lock:
                self.counts["refused"] += 1
        return allowed

    # ------------------------------------------------------------------ the ROUTER thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if poller.poll(10):
                frames = self._socket.recv_multipart(copy=False)
                try:
                    self._handle(frames)
                except Exception:  # noqa: BLE001 - no worker message may stop the ingress thread
                    self._count("errors")
            while True:
                try:
                    pending = self._done.get_nowait()
                except queue.Empty:
                    break
                self._reply(pending.identity, self._answer(verdicts=pending.verdicts))

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        worker = frames[-1].get("User-Id") if self._auth is not None else "anonymous"  # the CURVE key, z85
        if len(frames) != 3 or frames[1].bytes != b"":
            self._count("rejected/malformed", worker)
            return  # not a REQ envelope: nothing to answer
        try:
            request = REQUESTS.validate_json(frames[2].bytes)
        except ValidationError as exc:
            self._count("rejected/malformed", worker)
            self._reply(identity, self._error(f"malformed request: {exc.errors()[0]['msg']}"))
            return
        with self._lock:
            self.workers.add(worker)
            banned = worker in self.banned
        if banned:
            self._count("rejected/banned")
            self._reply(identity, self._error("this key is banned for the run", refused=True))
            return
        try:
            if isinstance(request, SpecRequest):
                self._reply(identity, self._answer(spec=self.spec))
            elif isinstance(request, WeightsRequest):
                self._weights(identity, request)
            elif isinstance(request, LeaseRequest):
                self._reply(identity, self._answer(leases=self._lease(worker, request.n)))
            elif isinstance(request, SubmitRequest):
                self._submit(identity, worker, request)
        except Exception as exc:  # noqa: BLE001 - no worker request may take the ingress down
            self._count("errors")
            self._reply(identity, self._error(f"the controller could not handle the request: {type(exc).__name__}"))

    def _weights(self, identity: bytes, request: WeightsRequest) -> None:
        with self._lock:
            published = self._base if request.base else self._published.get(request.version)
        if published is None and request.base:
            self._reply(identity, self._error("this run serves no base model: its versions are whole weights"))
            return
        if published is None:
            self._reply(
                identity, self._error(f"policy version {request.version} is not served; newest: {self.version}")
            )
            return
        with published.path.open("rb") as f:
            f.seek(request.offset)
            chunk = f.read(CHUNK_BYTES)
        info = WeightsChunk(
            version=request.version, size=published.size, sha256=published.sha256, offset=request.offset
        )
        self._count("weight_bytes_sent", n=len(chunk))
        self._reply(identity, self._answer(chunk=info), chunk)

    def _lease(self, worker: str, n: int) -> list[Lease]:
        now = time.monotonic()
        leases = []
        with self._lock:
            for record in sorted(self._by_key.values(), key=lambda r: r.step):
                if len(leases) == n:
                    break
                if record.state != "offered":
                    continue
                record.state, record.owner = "leased", worker
                record.leased_at, record.deadline = now, now + self.config.lease_timeout_s
                self.counts["leased"] += 1
                g = record.group
                leases.append(
                    Lease(
                        lease_id=record.lease_id,
                        prompt_id=g.prompt.prompt_id,
                        messages=g.prompt.messages,
                        info=g.prompt.info,
                        samples=g.samples,
                        seed=g.seed,
                        min_version=g.min_version,
                        expires_in_s=self.config.lease_timeout_s,
                    )  # fmt: skip
                )
        return leases

    def _submit(self, identity: bytes, worker: str, request: SubmitRequest) -> None:
        pending = _Pending(identity, [None] * len(request.groups))
        now = time.monotonic()
        for i, result in enumerate(request.groups):
            digest = hashlib.sha256(result.model_dump_json().encode()).hexdigest()
            verdict = self._admit(worker, result, digest, now)
            if verdict is None:
                pending.work.append((i, self._records[result.lease_id], result))
            else:
                pending.verdicts[i] = verdict
        if pending.work:
            self._verify_queue.put(pending)
        else:
            self._done.put(pending)

    def _admit(self, worker: str, result: GroupResult, digest: str, now: float) -> Verdict | None:
        """The verdict of a submission that needs no verification (unknown, foreign, repeated or
        late), or None: it goes to the verifier."""
        lease_id = result.lease_id
        with self._lock:
            record = self._records.get(lease_id)
            if record is None:
                if not lease_id.startswith(f"{self.epoch}-"):  # leased before the controller restarted
                    self.counts["late"] += 1
                    return Verdict(
                        lease_id=lease_id, status="late", reason="the controller restarted; the lease is void"
                    )
                return self._reject(worker, lease_id, "unknown_lease", "no such lease")
            if record.owner != worker:
                return self._reject(worker, lease_id, "not_owner", "the lease belongs to another key")
            if record.submitted:
                if record.submitted == digest:
                    self.counts["rejected/replayed"] += 1
                    return Verdict(lease_id=lease_id, status="duplicate", reason="already submitted")
                return self._reject(worker, lease_id, "replayed", "the lease was already submitted")
            record.submitted = digest
            if record.state != "leased" or now > record.deadline:
                self.counts["late"] += 1
                return Verdict(lease_id=lease_id, status="late", reason="the lease expired; its prompt went to another")
            record.state = "verifying"
        return None

    def _reject(self, worker: str, lease_id: str, reason: str, detail: str) -> Verdict:
        """Count a rejection and strike the key (call with the lock held); banned at max_strikes."""
        self.counts[f"rejected/{reason}"] += 1
        self._strike(worker)
        return Verdict(lease_id=lease_id, status="rejected", reason=f"{reason}: {detail}")

    def _strike(self, worker: str) -> None:
        """One more strike (call with the lock held); at max_strikes the key is banned for the run
        and its leases are reclaimed at once."""
        self.strikes[worker] += 1
        if self.strikes[worker] >= self.config.max_strikes and worker not in self.banned:
            self.banned.add(worker)
            for record in self._by_key.values():
                if record.owner == worker and record.state == "leased":
                    record.deadline = 0.0

    # ------------------------------------------------------------------ the verifier thread

    def _verify_loop(self) -> None:
        while (pending := self._verify_queue.get()) is not None:
            for i, record, result in pending.work:
                pending.verdicts[i] = self._verify(record, result)
            self._done.put(pending)

    def _verify(self, record: LeaseRecord, result: GroupResult) -> Verdict:
        group = record.group
        try:
            rollouts = self.verifier.check_group(
                group.prompt, group.samples, group.min_version, self.version, result.episodes
            )
        except Rejected as exc:
            with self._lock:
                record.state = "rejected"
                return self._reject(record.owner, record.lease_id, exc.reason, exc.detail)
        except Exception as exc:  # noqa: BLE001 - a submission that breaks a check is rejected, never fatal
            with self._lock:
                record.state = "rejected"
                return self._reject(record.owner, record.lease_id, "error", f"{type(exc).__name__}: {exc}")
        for rollout in rollouts:
            rollout.info["worker"] = record.owner
        with self._lock:
            record.state = "accepted"
            self._by_key.pop(group.key, None)
            self._accepted.append(FinishedGroup(group.key, rollouts, _wall(record.leased_at), time.time()))
            self.counts["accepted"] += 1
            self.counts["accepted_rollouts"] += len(rollouts)
        return Verdict(lease_id=record.lease_id, status="accepted")

    # ------------------------------------------------------------------ helpers

    def _count(self, name: str, worker: str | None = None, n: int = 1) -> None:
        """Count `name` (by n); with a worker, also strike it."""
        with self._lock:
            self.counts[name] += n
            if worker is not None:
                self._strike(worker)

    def _answer(self, **fields: Any) -> Reply:
        """A reply naming this epoch and the newest version, as every reply does."""
        return Reply(epoch=self.epoch, version=self.version, **fields)

    def _error(self, message: str, refused: bool = False) -> Reply:
        return self._answer(error=message, refused=refused)

    def _reply(self, identity: bytes, reply: Reply, payload: bytes | None = None) -> None:
        frames = [identity, b"", reply.model_dump_json().encode()]
        self._socket.send_multipart(frames if payload is None else [*frames, payload])


def _public_or_none(path: Path) -> bytes | None:
    try:
        return load_public(path)
    except ValueError:
        return None


def _wall(monotonic: float) -> float:
    """A time.monotonic() instant as time.time() (the timeline's clock)."""
    return time.time() - (time.monotonic() - monotonic)
