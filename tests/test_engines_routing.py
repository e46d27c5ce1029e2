"""generator.Engines: sticky sessions and least-loaded routing (fake actors, no vLLM)."""

import asyncio

from generator import Engines


class FakeMethod:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeEngine:
    def __init__(self, name):
        self.name, self.calls = name, []
        self.generate = FakeMethod(self._generate)

    async def _generate(self, ids, sampling, images=None):
        self.calls.append(len(ids))
        await asyncio.sleep(0.01)
        return {"engine": self.name}


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
