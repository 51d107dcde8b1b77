"""`cluster.serve --prefill-instances 1` starts a PD fleet from the command line: the launcher gives one emulated
engine process role prefill and the other role decode, the router hands each request off between them, and the
openai client reads the offline engine's greedy text, streamed and whole; the same with Ray actors (skipped without
ray). The launcher keeps the prefill count and starts spares as decode engines."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from conftest import completion_text, openai_client, serving_fleet

from cluster.fleet import InstanceStatus
from cluster.launcher import LocalLauncher
from cluster.serve import build_backend, parse_args
from engine import EngineConfig, SamplingParams

NUM_KV_BLOCKS = 128
MAX_TOKENS = 12
WAIT_S = 90.0


@contextlib.contextmanager
def pd_fleet(default_model: str, *argv: str):
    """`cluster.serve` with one prefill and one decode engine: (server, backend) once both serve."""
    with serving_fleet([
            "--model", default_model, "--executor", "emulated", "--num-kv-blocks", str(NUM_KV_BLOCKS),
            "--prefill-instances", "1", "--min-instances", "2", "--max-instances", "2", "--idle-pool", "0",
            "--warm-spares", "0", *argv]) as (server, backend):
        router = backend.service.router
        deadline = time.monotonic() + WAIT_S
        while sorted(router.roles.values()) != ["decode", "prefill"] or not all(
                v.status is InstanceStatus.READY for v in router.fleet.instances.values()):
            assert time.monotonic() < deadline, f"the PD fleet did not come up: roles {router.roles}"
            time.sleep(0.05)
        yield server, backend


@pytest.fixture(scope="module")
def pd_cluster(default_model):
    with pd_fleet(default_model) as (server, backend):
        yield backend, server


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_fleet_serves_offline_greedy_text_through_a_hand_off(pd_cluster, offline, stream):
    backend, server = pd_cluster
    counts = backend.service.counts
    handed_off = counts["handed_off"]
    prompt = f"A {'streamed' if stream else 'whole'} answer from two engines:"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text
    text = completion_text(server, stream, MAX_TOKENS, model=backend.model_name, prompt=prompt, temperature=0)
    assert text and text == want
    assert counts["handed_off"] == handed_off + 1
    assert counts["transfer_failed"] == 0 and counts["migrated"] == 0


def test_pd_fleet_of_ray_actors_hands_off(default_model, offline):
    ray = pytest.importorskip("ray", reason="ray is not installed (the `ray` extra of pyproject.toml)")
    from cluster.ray_launcher import connect_ray

    connect_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pd_fleet(default_model, "--launcher", "ray") as (server, backend):
            prompt = "Two actors, one answer:"
            want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text
            out = openai_client(server).completions.create(model=backend.model_name, prompt=prompt,
                                                           max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == want and want
            assert backend.service.counts["handed_off"] == 1
    finally:
        ray.shutdown()


@pytest.mark.parametrize("argv, message", [
    (["--prefill-instances", "2", "--min-instances", "2"], "below --min-instances"),
    (["--prefill-instances", "-1"], "non-negative"),
    (["--role", "decode"], "--prefill-instances N"),
    (["--prefill-instances", "1", "--min-instances", "2", "--decode-utilisation", "0"], "decode_utilisation"),
    (["--prefill-instances", "1", "--min-instances", "2", "--transfer-utilisation", "1.5"], "transfer_utilisation"),
])
def test_bad_prefill_instances_are_refused(default_model, argv, message):
    with pytest.raises(ValueError, match=message):
        build_backend(parse_args(["--model", default_model, "--executor", "emulated", *argv]))


FAKE_WORKER = """#!/bin/sh
printf '%s\\n' "$@" > "$ARGS_DIR/$$"
echo READY 1
exec sleep 60
"""


class FakeWorkers:
    """A stand-in for `python` that records the flags each worker process is given and reports ready at once."""

    def __init__(self, folder):
        self.python = folder / "python"
        self.python.write_text(FAKE_WORKER)
        self.python.chmod(0o755)
        self.args_dir = folder / "args"
        self.args_dir.mkdir()

    def launcher(self, config: EngineConfig, **kwargs) -> LocalLauncher:
        return LocalLauncher(config, python=str(self.python), env={"ARGS_DIR": str(self.args_dir)}, **kwargs)

    def roles(self) -> dict[str, str]:
        """instance id -> the role flag its worker got ("both": none)."""
        found = {}
        for file in self.args_dir.iterdir():
            argv = file.read_text().split("\n")
            role = argv[argv.index("--role") + 1] if "--role" in argv else "both"
            found[argv[argv.index("--instance-id") + 1]] = role
        return found


def test_launcher_keeps_the_prefill_count_and_starts_spares_as_decode(tmp_path):
    fake = FakeWorkers(tmp_path)

    async def scenario():
        launcher = fake.launcher(EngineConfig(executor="emulated"), warm_spares=1, prefill_instances=1)
        try:
            await asyncio.gather(launcher.start("a"), launcher.start("b"), launcher.start_spare("spare-1"))
            assert fake.roles() == {"a": "prefill", "b": "decode", "spare-1": "decode"}
            assert launcher.take_spare()[0] == "spare-1"
            launcher.kill("a")
            await launcher.stop("a")
            assert launcher.num_prefill_short() == 1
            await launcher.start_spare("spare-2")
            assert launcher.take_spare() is None  # a spare is a decode engine: the missing prefill one starts cold
            await launcher.start("c")
            assert fake.roles()["spare-2"] == "decode" and fake.roles()["c"] == "prefill"
            assert launcher.num_prefill_short() == 0 and launcher.take_spare()[0] == "spare-2"
        finally:
            await launcher.close()

    asyncio.run(scenario())


def test_launcher_without_disaggregation_keeps_the_configured_role(tmp_path):
    fake = FakeWorkers(tmp_path)
    with pytest.raises(ValueError, match="prefill_instances"):
        fake.launcher(EngineConfig(executor="emulated"), prefill_instances=-1)

    async def scenario():
        launcher = fake.launcher(EngineConfig(executor="emulated", role="decode"))
        try:
            await launcher.start("a")
        finally:
            await launcher.close()

    asyncio.run(scenario())
    assert fake.roles() == {"a": "decode"}
