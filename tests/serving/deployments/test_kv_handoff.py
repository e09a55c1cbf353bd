"""KVHandoff, the callers' side of the KV hand-off, against a fake KVTransfer actor: one lookup per
node, an offer made again to a restarted actor, a fetch that says why it got nothing, releases in
the background that never fail their caller."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from serving.config import KVTransferConfig
from serving.deployments import kv_handoff
from serving.deployments.kv_handoff import KVHandoff
from serving.deployments.messages import ClaimMiss, KVHandle


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append((self.name, args))
        return self.actor.answer(self.name, args)


class FakeActor:
    """Answers like KVTransfer; `fail` makes the next calls of a method raise an actor error."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}
        self.claim_answer: object = ClaimMiss.TIMEOUT
        self.payload: object = "payload"

    def __getattr__(self, name):
        if name in ("offer", "claim", "release"):
            return _Method(self, name)
        raise AttributeError(name)

    async def answer(self, name, args):
        if self.fail.get(name, 0) > 0:
            self.fail[name] -= 1
            raise ray.exceptions.ActorUnavailableError("the actor is restarting", None)
        if name == "claim":
            answer = self.claim_answer
            if isinstance(answer, list):
                return [self._ref()]
            return answer
        return True

    def _ref(self):
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.payload)
        return future


@pytest.fixture
def actor(monkeypatch):
    """The node's actor: every lookup finds the same one (a restarted actor keeps its name)."""
    the_actor = FakeActor()
    the_actor.lookups = 0

    def get_or_create(app_name, node_id, arena_bytes=0):
        the_actor.lookups += 1
        return the_actor

    monkeypatch.setattr(kv_handoff, "get_or_create", get_or_create)
    return the_actor


KV = KVHandle("r1", "node", num_tokens=40, num_bytes=1024)


def handoff(**config) -> KVHandoff:
    return KVHandoff("app", KVTransferConfig(**{"lease_s": 30.0, "timeout_s": 5.0, **config}))


async def settled(kv: KVHandoff) -> None:
    while kv._background:
        await asyncio.sleep(0)


def test_one_lookup_per_node_and_a_new_one_after_an_actor_error(actor):
    async def main():
        kv = handoff()
        await kv.offer("node", "r1", "ref", 1024)
        await kv.offer("node", "r2", "ref", 1024)
        assert actor.lookups == 1
        actor.fail["offer"] = 1  # died: the offer goes once more, to the restarted actor
        await kv.offer("node", "r3", "ref", 1024)
        assert actor.lookups == 2
        assert actor.calls[-2:] == [("offer", ("r3", ["ref"], 1024, 30.0))] * 2
        actor.fail["offer"] = 2  # dead twice: the offer fails (the decode worker recomputes)
        with pytest.raises(ray.exceptions.ActorUnavailableError):
            await kv.offer("node", "r4", "ref", 1024)

    asyncio.run(main())


@pytest.mark.parametrize("miss", [ClaimMiss.RELEASED, ClaimMiss.EXPIRED])
def test_a_fetch_that_gets_nothing_says_why(actor, miss):
    async def main():
        kv = handoff()
        await kv.actor("node")
        actor.claim_answer = miss
        assert await kv.fetch(KV) is miss
        await settled(kv)
        assert [name for name, _ in actor.calls] == ["claim"]  # nothing to release

    asyncio.run(main())


# "timeout": the plain string a KVTransfer actor of 0.1.0 (detached, reused) answers.
@pytest.mark.parametrize("answer", [ClaimMiss.TIMEOUT, "timeout"])
def test_a_claim_that_timed_out_releases_the_late_offer(actor, answer):
    async def main():
        kv = handoff()
        await kv.actor("node")
        actor.claim_answer = answer
        assert await kv.fetch(KV) is ClaimMiss.TIMEOUT
        await settled(kv)
        assert actor.calls == [("claim", ("r1", 5.0, None, 30.0)), ("release", ("r1",))]

    asyncio.run(main())


def test_a_fetch_gets_the_payload(actor):
    async def main():
        kv = handoff()
        await kv.actor("node")
        actor.claim_answer = []
        assert await kv.fetch(KV) == ("payload", None)

    asyncio.run(main())


def test_an_actor_error_during_a_fetch_is_an_error_miss_that_looks_the_actor_up_again(actor):
    async def main():
        kv = handoff()
        await kv.actor("node")
        actor.fail["claim"] = 1
        assert await kv.fetch(KV) is ClaimMiss.ERROR
        await settled(kv)
        # The restarted actor, looked up again, is told to drop this request's offer, which the
        # prefill worker makes again to it.
        assert actor.lookups == 2 and actor.calls == [("claim", ("r1", 5.0, None, 30.0)), ("release", ("r1",))]

    asyncio.run(main())


def test_a_release_is_made_again_to_a_restarted_actor_and_never_raises(actor, monkeypatch):
    """A release that meets a restarting actor is made again (else the offer the prefill worker
    makes again to the restarted actor would be held until its lease ran out); one that fails
    every time is logged, never raised (the lease frees it)."""
    monkeypatch.setattr(kv_handoff, "RELEASE_RETRY_DELAYS_S", (0.0, 0.0, 0.0))

    async def main():
        kv = handoff()
        await kv.actor("node")
        actor.fail["release"] = 2
        await kv.release("node", "r1")
        assert [name for name, _ in actor.calls] == ["release"] * 3 and actor.lookups == 3
        actor.fail["release"] = 4  # dead throughout: 1 + 3 tries, then the lease frees it
        kv.release_soon(KV)
        await settled(kv)
        assert [name for name, _ in actor.calls] == ["release"] * 7 and actor.fail["release"] == 0

    asyncio.run(main())


def test_a_release_runs_outside_the_context_of_the_request_being_cancelled(actor):
    """Ray keeps an async actor's current task in a context variable and cancels the calls a
    cancelled task made: a release made in a cancelled request's cleanup must not carry it."""
    import contextvars

    current_task = contextvars.ContextVar("current_task", default=None)
    seen = []
    real = actor.answer

    async def answer(name, args):
        seen.append((name, current_task.get()))
        return await real(name, args)

    actor.answer = answer

    async def main():
        kv = handoff()
        current_task.set("the cancelled request")
        kv.release_soon(KV)
        await settled(kv)

    asyncio.run(main())
    assert seen == [("release", None)]


def test_a_looked_up_actor_is_waited_for_once_before_its_first_call(actor):
    """A new actor starts (and pre-faults its arena) before its first call returns: the lookup
    waits for it, so no call's own bound (a reservation's 1 s) pays for the start."""
    readied = []

    class Ready:
        def remote(self):
            readied.append(len(actor.calls))

            async def ready():
                return True

            return ready()

    actor.__dict__["__ray_ready__"] = Ready()

    async def main():
        kv = handoff()
        await kv.offer("node", "r1", "ref", 1024)
        await kv.offer("node", "r2", "ref", 1024)

    asyncio.run(main())
    assert readied == [0] and [name for name, _ in actor.calls] == ["offer", "offer"]  # once, before the first call
