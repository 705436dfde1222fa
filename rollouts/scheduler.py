"""Per-episode scheduling: every episode advances on its own, on one engine.

Two threads serve a generator. The engine thread owns the model: it starts the turns
episodes ask for (prefilling only what an episode's KV cache lacks), advances all running
turns one token per forward (`DecodeBatch`), and swaps in new weights between two decode
steps, so a turn may span policy versions (each token records its own). The episode
thread runs an asyncio loop with one coroutine per episode: it awaits its turn, runs the
turn's tool calls in a thread pool (concurrently with other episodes' calls and with
decoding), and asks for the next turn. A finished episode frees its slot at once for the
next queued one. Finished groups (all samples of a prompt) wait in an outbox for `take`.

A tool call, or the tool turn answering it, that raises ends its own episode (`TOOL_FAILED`,
reward 0, logged with its traceback): the policy writes the calls, and no call may stop the
run. Any other error (the engine's, a prompt too long for an episode) still fails the scheduler.

Caps: `max_episodes` episodes run at once; `max_tokens` bounds the KV tokens held (running
turns count their prompt plus `max_new_tokens`, idle episodes between turns their cache).
A turn that does not fit first evicts idle caches (those episodes prefill again later),
then waits for running turns to end; one that cannot fit alone is an error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.inference.completion import Completion, request_seeds
from meshrl.rollouts.episodes import TOOL_FAILED, EpisodeFormat, Rollout
from meshrl.tasks.base import Episodic, Prompt

log = logging.getLogger(__name__)


@dataclass
class GroupRequest:
    """One prompt to sample `samples` episodes of; `key` names it for the controller."""

    key: str
    prompt: Prompt
    samples: int
    seed: int
    min_version: int = 0  # its episodes start once the engine runs this policy version or a newer one


@dataclass
class FinishedGroup:
    """A group's rollouts (scored) and when its first episode started and its last ended (time.time())."""

    key: str
    rollouts: list[Rollout]
    started: float
    finished: float


@dataclass
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass
class SchedulerStats:
    """Counters since the scheduler started."""

    episodes: int = 0
    turns: int = 0
    sampled_tokens: int = 0
    prefilled_tokens: int = 0  # ids fed to the model outside decode steps
    evictions: int = 0  # idle caches dropped to fit a turn
    weight_updates: int = 0
    tool_calls: int = 0
    max_running_tools: int = 0


@dataclass
class _Turn:
    seq: Any  # the engine's Sequence
    future: asyncio.Future[Completion]
    need: int  # KV tokens the turn may hold
    queued: float = field(default_factory=time.perf_counter)


class EpisodeScheduler:
    """Runs submitted groups' episodes, each on its own, and hands back finished groups."""

    def __init__(
        self,
        engine: Any,
        episodes: EpisodeFormat,
        sampling: Sampling,
        *,
        max_episodes: int,
        max_tokens: int,
    ) -> None:
        self.engine, self.format, self.sampling = engine, episodes, sampling
        self.max_tokens = max_tokens
        self.stats = SchedulerStats()
        self.error: BaseException | None = None
        self.outbox: queue.Queue[FinishedGroup] = queue.Queue()
        self._tools = ThreadPoolExecutor(max_workers=max_episodes, thread_name_prefix="tools")
        self._running_tools = 0
        self._open: dict[str, Rollout] = {}  # episodes started and not yet ended, by episode_id
        # handed to the engine thread, guarded by _cond
        self._cond = threading.Condition()
        self._waiting: deque[_Turn] = deque()
        self._releases: list[Any] = []
        self._staged: tuple[dict[str, torch.Tensor], int, threading.Event] | None = None
        self._closed = False
        # the engine thread's own
        self._idle: OrderedDict[int, Any] = OrderedDict()  # id(seq) -> seq, least recently used first
        self._running: dict[int, _Turn] = {}
        self.loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(max_episodes)
        self._threads = [
            threading.Thread(target=self.loop.run_forever, name="episodes", daemon=True),
            threading.Thread(target=self._engine_loop, name="engine", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ from other threads

    def submit(self, requests: list[GroupRequest]) -> None:
        """Queue groups; their episodes start in order as slots free up."""
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._group(request), self.loop)

    def take(self, wait_s: float) -> list[FinishedGroup]:
        """The finished groups: waits up to `wait_s` for the first, then takes whatever else is there."""
        self.check()
        try:
            groups = [self.outbox.get(timeout=wait_s)]
        except queue.Empty:
            self.check()
            return []
        while True:
            try:
                groups.append(self.outbox.get_nowait())
            except queue.Empty:
                return groups

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> threading.Event:
        """Stage a policy version; the engine loads it between two decode steps (a newer one
        staged before that replaces it). Returns at once, with an event set once it is loaded
        (or replaced by a newer one, or failed: `check` raises then)."""
        loaded = threading.Event()
        with self._cond:
            if self._staged is not None:
                self._staged[2].set()
            self._staged = (weights, version, loaded)
            self._cond.notify()
        return loaded

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.loop.call_soon_threadsafe(self._stop_loop)
        for thread in self._threads:
            thread.join(timeout=10)
        self._tools.shutdown(wait=False, cancel_futures=True)
        self.engine.close()  # an engine with a thread of its own (continuous batching) stops it
        for rollout in list(self._open.values()):  # episodes cancelled or failed mid-way
            self._end_episode(rollout)

    def _stop_loop(self) -> None:
        """Cancel the episodes still running or queued (their groups are abandoned), then stop."""
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.stop()

    def check(self) -> None:
        """Raise the error that stopped the scheduler (an engine's, a task's), if one did."""
        if self.error is not None:
            raise RuntimeError(
                f"the episode scheduler failed: {type(self.error).__name__}: {self.error}"
            ) from self.error

    # ------------------------------------------------------------------ episode thread (asyncio)

    async def _group(self, request: GroupRequest) -> None:
        try:
            while self.engine.version < request.min_version:
                await asyncio.sleep(0.002)
            seeds = request_seeds(request.seed, request.samples)
            started = time.time()
            rollouts = await asyncio.gather(*(self._episode(request.prompt, seed) for seed in seeds))
            self.outbox.put(FinishedGroup(request.key, list(rollouts), started, time.time()))
        except BaseException as exc:  # noqa: BLE001 - a task or engine error fails the generator, loudly
            self._fail(exc)

    async def _episode(self, prompt: Prompt, seed: int | None) -> Rollout:
        async with self._slots:
            rollout = self.format.start(prompt)
            self._open[rollout.episode_id] = rollout
            seq = self.engine.sequence(rollout.token_ids, seed)
            try:
                while True:
                    completion = await self._turn(seq)
                    calls = self.format.add_turn(rollout, completion)
                    if calls:
                        tool_ids = await self._tool_turn(rollout, calls)
                        if tool_ids is None:
                            break
                        seq.extend(tool_ids)
                    # off the loop: a task's stop check may block (verifiers' run on their own loop)
                    contexts = len(rollout.earlier)
                    if not await self.loop.run_in_executor(self._tools, self.format.goes_on, rollout, calls):
                        break
                    if len(rollout.earlier) != contexts:  # tool results elided: the next turn prefills the new context
                        self._release(seq)
                        seq = self.engine.sequence(
                            rollout.token_ids, None if seed is None else seed + 7919 * contexts + 1
                        )
            finally:
                self._release(seq)
            await self.loop.run_in_executor(self._tools, self._end_episode, rollout)
            await self.loop.run_in_executor(self._tools, self.format.score, rollout)
            self.stats.episodes += 1
            return rollout

    def _end_episode(self, rollout: Rollout) -> None:
        """The episode is over: its task state goes (`EpisodeFormat.end`)."""
        self._open.pop(rollout.episode_id, None)
        self.format.end(rollout)

    async def _tool_turn(self, rollout: Rollout, calls: list[dict[str, Any]]) -> list[int] | None:
        """The ids of the tool turn answering `calls`, added to the rollout; None when a call or the
        turn raised, which ends this episode alone (`TOOL_FAILED`): the policy shapes its calls."""
        try:
            if isinstance(self.format.task, Episodic):  # one workspace: in message order
                results = [await self._tool(rollout, call) for call in calls]
            else:
                results = list(await asyncio.gather(*(self._tool(rollout, call) for call in calls)))
            return self.format.add_tool_results(rollout, calls, results)
        except Exception:
            log.exception("a tool call of episode %s of prompt %s raised: the episode ends, reward 0",
                          rollout.episode_id, rollout.prompt.prompt_id)  # fmt: skip
            rollout.stop_condition = TOOL_FAILED
            return None

    async def _tool(self, rollout: Rollout, call: dict[str, Any]) -> Any:
        self._running_tools += 1
        self.stats.tool_calls += 1
        self.stats.max_running_tools = max(self.stats.max_running_tools, self._running_tools)
        try:
            return await self.loop.run_in_executor(self._tools, self.format.call_tool, rollout, call)
        finally:
            self._running_tools -= 1

    async def _turn(self, seq: Any) -> Completion:
        future: asyncio.Future[Completion] = self.loop.create_future()
        need = len(seq.ids) + self.sampling.max_new_tokens
        if need > self.max_tokens:
            raise ValueError(
                f"an episode of {len(seq.ids)} tokens plus generator.max_new_tokens {self.sampling.max_new_tokens} "
                f"does not fit generator.max_concurrent_tokens {self.max_tokens}"
            )
        with self._cond:
            self._waiting.append(_Turn(seq, future, need))
            self._cond.notify()
        return await future

    def _release(self, seq: Any) -> None:
        with self._cond:
            self._releases.append(seq)
            self._cond.notify()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    # ------------------------------------------------------------------ engine thread

    def _engine_loop(self) -> None:
        batch = self.engine.batch()
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._waiting or self._releases or self._staged or len(batch)):
                        self._cond.wait()
                    if self._closed:
                        return
                    staged, self._staged = self._staged, None
                    releases, self._releases = self._releases, []
                    admitted = self._admit(batch)
                for seq in releases:
                    self._idle.pop(id(seq), None)
                    seq.release()
                if staged is not None:
                    weights, version, loaded = staged
                    try:
                        self.engine.load_weights(weights, version)
                    except BaseException as exc:
                        self._fail(exc)
                        raise
                    finally:  # the loop stops on a failed load; its waiter learns why from `check`
                        loaded.set()
                    self.stats.weight_updates += 1
                if admitted:
                    self._start(admitted, batch)
                if len(batch):
                    self.stats.sampled_tokens += len(batch)
                    for seq in batch.step():
                        self._end(self._running.pop(id(seq)))
        except BaseException as exc:  # noqa: BLE001 - surfaced by take() and by every waiting episode
            self._fail(exc)
            for turn in [*self._running.values(), *self._waiting]:
                self.loop.call_soon_threadsafe(_set_exception, turn.future, exc)

    def _held(self) -> int:
        return sum(t.need for t in self._running.values()) + sum(seq.cached for seq in self._idle.values())

    def _admit(self, batch: Any) -> list[_Turn]:
        """Waiting turns that fit the token cap, oldest first; idle caches are evicted to make room."""
        admitted = []
        while self._waiting:
            turn = self._waiting[0]
            idle = self._idle.pop(id(turn.seq), None)
            held = self._held()
            while held + turn.need > self.max_tokens and self._idle:
                _, evicted = self._idle.popitem(last=False)
                held -= evicted.cached
                evicted.release()
                self.stats.evictions += 1
            if held + turn.need > self.max_tokens:
                if idle is not None:
                    self._idle[id(turn.seq)] = idle
                break
            self._waiting.popleft()
            self._running[id(turn.seq)] = turn
            admitted.append(turn)
        return admitted

    def _start(self, turns: list[_Turn], batch: Any) -> None:
        """Begin the admitted turns together (the engine prefills new episodes in one batch)."""
        s = self.sampling
        seqs = [turn.seq for turn in turns]
        self.stats.prefilled_tokens += sum(len(seq.ids) - seq.cached for seq in seqs)
        going = self.engine.begin_turns(
            seqs, temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
            stop_token_ids=self.format.stop_ids,
        )  # fmt: skip
        self.stats.sampled_tokens += len(seqs)
        for seq, on in zip(seqs, going):
            if on:
                batch.add(seq)
            else:
                self._end(self._running.pop(id(seq)))

    def _end(self, turn: _Turn) -> None:
        self._idle[id(turn.seq)] = turn.seq
        self.stats.turns += 1
        self.loop.call_soon_threadsafe(_set_result, turn.future, turn.seq.turn)


def _set_result(future: asyncio.Future[Completion], value: Completion) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Completion], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
