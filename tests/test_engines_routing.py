"""generator.Engines: sticky sessions and least-loaded routing (fake actors, no vLLM)."""

import asyncio

import pytest

import generator
from generator import Engines


class FakeMethod:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.fn(*args)


async def ready(value):
    return value


class FakeEngine:
    """Answers generate_batch like the Ray actor: a stream of awaitable lists of answers."""

    def __init__(self, name):
        self.name, self.calls, self.batches, self.cancelled = name, [], 0, []
        self.generate_batch = FakeMethod(self._batch)
        self.cancel = FakeMethod(self.cancelled.extend)

    async def _batch(self, requests):
        self.batches += 1
        for rid, ids, sampling, images in requests:
            self.calls.append(len(ids))
            await asyncio.sleep(0.01)
            yield ready([(rid, {"engine": self.name}, None)])


def test_sessions_stick_and_spread_by_load():
    a, b = FakeEngine("a"), FakeEngine("b")
    engines = Engines([a, b])

    async def rollout(turns):
        gen = engines.session()
        return {(await gen([0] * (10 + t), {"max_tokens": 5}))["engine"] for t in range(turns)}

    async def go():
        return await asyncio.gather(*[rollout(3) for _ in range(6)])

    used = asyncio.run(go())
    assert all(len(u) == 1 for u in used)            # every multi-turn rollout stayed on one engine
    assert len(a.calls) == len(b.calls) == 9         # and the 6 rollouts split 3/3
    assert engines.load == [0, 0]                    # nothing counted as in flight afterwards


class ScriptedEngine:
    """generate_batch answers from a script: error text for some ids, death after some answers."""

    def __init__(self, fail: set[int] = frozenset(), die_after: int | None = None):
        self.batches, self.cancelled, self.fail, self.die_after = [], [], fail, die_after
        self.generate_batch = FakeMethod(self._batch)
        self.cancel = FakeMethod(self.cancelled.extend)

    async def _batch(self, requests):
        self.batches.append([ids[0] for _, ids, _, _ in requests])
        for n, (rid, ids, sampling, images) in enumerate(requests):
            if self.die_after is not None and n == self.die_after:
                raise ConnectionError("engine actor died")
            await asyncio.sleep(0.005)
            yield ready([(rid, None, "ValueError: prompt too long") if ids[0] in self.fail
                         else (rid, {"token_ids": [ids[0]]}, None)])


def run_requests(engine, firsts, cancel_when=None):
    """Send requests (first ids `firsts`); with `cancel_when`, cancel the first request as soon
    as cancel_when() is true (checked each loop iteration, from right after they are queued)."""
    engines = Engines([engine])

    async def one(k):
        return (await engines.session()([k, 1, 2], {"max_tokens": 1}))["token_ids"]

    async def go():
        tasks = [asyncio.ensure_future(one(k)) for k in firsts]
        if cancel_when is not None:
            await asyncio.sleep(0)   # the requests are queued (in the batch window), none sent
            while not cancel_when():
                await asyncio.sleep(0)
            tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True), engines
    return asyncio.run(go())


def test_requests_that_arrive_together_travel_in_one_ray_call_and_come_back_to_their_callers():
    engine = ScriptedEngine()
    out, engines = run_requests(engine, range(10))
    assert engine.batches == [list(range(10))]          # one generate_batch call
    assert out == [[k] for k in range(10)]           # each caller gets its own answer


def test_an_engine_error_fails_only_its_request_and_says_it_is_the_engines():
    out, engines = run_requests(ScriptedEngine(fail={3}), range(5))
    assert isinstance(out[3], generator.EngineError) and "prompt too long" in str(out[3])
    assert Engines.is_engine_error(out[3])           # the loop stops the run, as for any engine failure
    assert [o for k, o in enumerate(out) if k != 3] == [[0], [1], [2], [4]]


def test_a_dead_engine_fails_every_request_of_its_batch():
    out, _ = run_requests(ScriptedEngine(die_after=2), range(5))
    assert out[:2] == [[0], [1]]
    assert all(isinstance(o, ConnectionError) for o in out[2:])


def test_cancelling_a_request_unsends_it_or_cancels_it_in_the_engine():
    engine = ScriptedEngine()
    out, engines = run_requests(engine, range(3), cancel_when=lambda: True)   # still in the batch window
    assert isinstance(out[0], asyncio.CancelledError) and engine.batches == [[1, 2]] and engine.cancelled == []
    engine = ScriptedEngine()
    out, engines = run_requests(engine, range(3), cancel_when=lambda: engine.batches)  # sent, not answered
    assert isinstance(out[0], asyncio.CancelledError) and engine.batches == [[0, 1, 2]]
    assert engine.cancelled == ["q0"] and out[1:] == [[1], [2]] and engines.load == [0]


def test_a_weight_update_fails_at_once_when_one_side_of_the_broadcast_dies():
    """The surviving peers of a broadcast wait in the group (10 min timeout): the update must
    raise as soon as the trainer or any engine fails, not when the others give up."""
    class Trainer:
        def __init__(self, fail):
            self.fail = fail

        async def _broadcast(self):
            if self.fail:
                raise ConnectionError("trainer rank 0 died")
            await asyncio.sleep(60)          # blocked in the broadcast, waiting for a dead engine

        def call(self, method, *args):
            return self._broadcast()

    class Engine:
        def __init__(self, fail):
            self.fail = fail
            self.update_weights = FakeMethod(self._update)

        async def _update(self, blob, version):
            if self.fail:
                raise ConnectionError("engine 1 died")
            await asyncio.sleep(60)          # receiving from a dead trainer
            return {"seconds": 0.0, "missing": []}

    async def update(trainer_fails, engine_fails):
        engines = Engines([Engine(False), Engine(engine_fails)], broadcast=True)
        return await asyncio.wait_for(engines.update_weights(Trainer(trainer_fails), 1), 5.0)

    # (Had it waited for the blocked peers, wait_for would raise TimeoutError, not their error.)
    for trainer_fails, engine_fails, who in ((False, True, "engine 1"), (True, False, "trainer rank 0")):
        with pytest.raises(ConnectionError, match=who):
            asyncio.run(update(trainer_fails, engine_fails))


def test_the_version_is_asked_once_then_follows_weight_updates():
    """A group's start version (for staleness and start_version_lag) costs no Ray call per
    group: the engines are asked once, then the driver's own updates say it."""
    class Engine:
        def __init__(self):
            self.asked = 0
            self.get_version = FakeMethod(self._version)
            self.update_weights = FakeMethod(self._update)

        async def _version(self):
            self.asked += 1
            return 4                         # e.g. a resumed run's engines

        async def _update(self, blob, version):
            return {"seconds": 0.0, "missing": []}

    class Trainer:
        def weights_blob(self):
            return b""

    engine = Engine()
    engines = Engines([engine])

    async def go():
        seen = [await engines.version() for _ in range(3)]
        await engines.update_weights(Trainer(), 5)
        return seen + [await engines.version()]
    assert asyncio.run(go()) == [4, 4, 4, 5] and engine.asked == 1
