"""Shared fixtures: tiny random-weight checkpoints of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype "auto" on a CPU picks float32 whatever the CPU (the tests compare with float32 references).
os.environ.setdefault("RADIXD_CPU_AUTO_DTYPE", "float32")
# cuDNN attention's bucketed plans (attention.dense_prefill), asked for before the process's first
# cuDNN attention, as a daemon's engine asks: else an engine made after a test that ran torch's
# SDPA keeps its long prompts on the extend kernel (torch reads the setting once).
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter (set before triton is used).
    os.environ.setdefault("TRITON_INTERPRET", "1")

def grammar_suite():
    """benchmarks/grammar_suite.py (the JSON Schema suite the benchmark and the tests share)."""
    from benchmarks import grammar_suite

    return grammar_suite


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=256,
)


def _tokenizer():
    """A small byte-level BPE tokenizer trained here (no hub access needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The capital of France is Paris.", "hello world, hello radix attention",
              "abcdefghijklmnopqrstuvwxyz 0123456789"] * 10
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def make_tiny_checkpoint(path: Path, arch: str, seed: int = 0, max_shard_size: str | None = None,
                         tokenizer=None) -> Path:
    """A random-weight checkpoint of ``arch`` with ``_tokenizer()`` (or ``tokenizer``, e.g. one
    with added tokens: the vocabulary is sized to it)."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MinistralConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    tok = tokenizer if tokenizer is not None else _tokenizer()
    vocab = TINY["vocab_size"] if tokenizer is None else max(TINY["vocab_size"], max(tokenizer.get_vocab().values()) + 1)
    torch.manual_seed(seed)
    kw = dict(TINY, vocab_size=vocab, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(**kw, rope_theta=10000.0, tie_word_embeddings=False)
    elif arch == "llama-tied":
        cfg = LlamaConfig(**kw, tie_word_embeddings=True)
    elif arch == "llama3-rope":  # Llama 3.1-style scaled rotary embedding
        rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32, rope_theta=500000.0)
        cfg = LlamaConfig(**kw, rope_parameters=rope, tie_word_embeddings=False)
    elif arch == "mistral":
        cfg = MistralConfig(**kw, sliding_window=4096, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg = Qwen2Config(**kw, tie_word_embeddings=False)
    elif arch == "qwen3":
        cfg = Qwen3Config(**kw, head_dim=32, tie_word_embeddings=False)
    elif arch == "qwen3-moe":  # layer 1 of 3 dense (mlp_only_layers)
        cfg = Qwen3MoeConfig(**{**kw, "num_hidden_layers": 3}, head_dim=32, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                             tie_word_embeddings=False)
    elif arch == "qwen2-moe":  # a shared expert with its sigmoid gate; top-k weights not renormalised
        cfg = Qwen2MoeConfig(**kw, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False)
    elif arch == "mixtral":
        cfg = MixtralConfig(**{**kw, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=False)
    elif arch == "olmo2":
        cfg = Olmo2Config(**kw, tie_word_embeddings=False)
    elif arch == "granite":  # every scaling away from 1, so a missed one changes the tokens
        cfg = GraniteConfig(**kw, attention_multiplier=0.3, embedding_multiplier=4.0, residual_multiplier=0.6,
                            logits_scaling=2.5, tie_word_embeddings=True)
    elif arch == "phi3":  # longrope past an original context of 16 (the tests' prompts are longer)
        half = kw["hidden_size"] // kw["num_attention_heads"] // 2
        rope = dict(rope_type="longrope", rope_theta=10000.0, long_factor=[1.0 + 0.7 * i for i in range(half)],
                    short_factor=[1.0 + 0.1 * i for i in range(half)])
        cfg = Phi3Config(**kw, original_max_position_embeddings=16, rope_parameters=rope, tie_word_embeddings=False)
    elif arch == "gemma2":  # windows of 8 on layers 0 and 2; caps low enough to bite at these scales
        cfg = Gemma2Config(**{**kw, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                           attn_logit_softcapping=0.5, final_logit_softcapping=3.0, tie_word_embeddings=True)
    elif arch == "gemma3":  # two sliding layers (base 10^4), then a global one (10^6, linearly scaled)
        rope = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)}
        cfg = Gemma3TextConfig(**{**kw, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=8, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                               rope_parameters=rope, tie_word_embeddings=True)
    elif arch == "mistral-swa":  # every layer's window 8 tokens, shorter than the tests' prompts
        cfg = MistralConfig(**kw, sliding_window=8, tie_word_embeddings=False)
    elif arch == "ministral":  # a sliding layer, then a global one
        cfg = MinistralConfig(**kw, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              tie_word_embeddings=False)
    elif arch == "qwen2-swa":  # layer 0 global, layer 1 (from max_window_layers on) a window of 8
        cfg = Qwen2Config(**kw, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                          tie_word_embeddings=False)
    elif arch == "qwen2-yarn":  # Qwen2.5's long-context setting: yarn past an original context of 32
        rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0)
        cfg = Qwen2Config(**kw, rope_parameters=rope, tie_word_embeddings=False)
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-ties
        for p in model.parameters():
            if p.dim() >= 2:  # (matrices, and the experts' stacked [E, out, in] projections)
                p.normal_(0, 0.15)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: make_tiny_checkpoint(root / a, a) for a in ("llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3")}


MOE_ARCHS = ("qwen3-moe", "qwen2-moe", "mixtral")


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    """Mixture-of-experts checkpoints, apart from ``tiny_models`` so only their tests pay for them."""
    root = tmp_path_factory.mktemp("moe_models")
    return {a: make_tiny_checkpoint(root / a, a) for a in MOE_ARCHS}


DENSE_ARCHS = ("olmo2", "granite", "phi3", "gemma2", "gemma3", "mistral-swa", "ministral", "qwen2-swa")


@pytest.fixture(scope="session")
def tiny_dense_models(tmp_path_factory) -> dict[str, Path]:
    """The dense families beyond Llama/Qwen, apart from ``tiny_models`` so only their tests pay for them."""
    root = tmp_path_factory.mktemp("dense_models")
    return {a: make_tiny_checkpoint(root / a, a) for a in DENSE_ARCHS}


def hf_greedy(path: Path, prompt_ids: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and per-step logits (fp32, CPU): the correctness oracle."""

    model = _hf_model(path)
    ids = torch.tensor([prompt_ids])
    # an explicit mask: a prompt token equal to the pad id is still a token, not padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=1)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    return toks, torch.stack(out.logits, 1)[0]


_HF_CACHE: dict[Path, object] = {}


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


class Daemon:
    """A real ``radixd --config FILE`` subprocess on a free loopback port."""

    def __init__(self, tmp: Path, toml: str, env: dict | None = None):
        import subprocess
        import sys

        self.config = tmp / "radixd.toml"
        self.config.write_text(toml)
        self.log_path = tmp / "radixd.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixd", "--config", str(self.config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.port = self._wait_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_port(self, timeout: float = 180.0) -> int:
        import json
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if line.startswith("{") and '"listening"' in line:
                    return json.loads(line)["port"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixd exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"radixd did not start:\n{self.log_path.read_text()[-3000:]}")

    def log_lines(self) -> list[dict]:
        import json

        return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.startswith("{")]

    def stop(self) -> int:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def assert_kv_idle(http, timeout: float = 10.0) -> dict:
    """A daemon's KV (``http``: an httpx client on it) all free or evictable: nothing locked,
    nothing private. A request's KV is released when the engine finishes it, which can be just
    after the client has read its last byte, so this waits up to ``timeout`` before asserting."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        kv = http.get("/server_info").json()["stats"]["kv"]
        idle = kv["locked"] == 0 and kv["private"] == 0 and kv["free"] + kv["evictable"] == kv["total"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert kv["locked"] == 0 and kv["private"] == 0, kv
    assert kv["free"] + kv["evictable"] == kv["total"], kv
    return kv


def plugin_site(tmp: Path, name: str, source: str) -> Path:
    """A folder for a daemon's PYTHONPATH holding module ``name`` (``source``) and a
    dist-info whose ``radixd`` entry point loads it: a plugin installed for that daemon only."""
    import textwrap

    site = tmp / "site"
    (site / f"{name}-0.0.0.dist-info").mkdir(parents=True)
    (site / f"{name}.py").write_text(textwrap.dedent(source))
    (site / f"{name}-0.0.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    (site / f"{name}-0.0.0.dist-info" / "entry_points.txt").write_text(f"[radixd]\n{name} = {name}\n")
    return site


CONTRIB = Path(__file__).resolve().parent.parent / "plugins-contrib"


CONTRIB_ENTRIES = {"radixd-mooncake": "mooncake", "radixd-priority": "priority", "radixd-redis": "redis",
                   "radixd-xgrammar": "xgrammar"}
# the contrib packages pytest-xdist's controller installed for the whole run (comma-separated)
CONTRIB_RUN_ENV = "RADIXD_TESTS_CONTRIB_INSTALLED"


def _pip_env() -> dict[str, str]:
    return {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}


def _contrib_installed(package: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip_install_copy(package: str, tmp_dir: Path) -> None:
    """pip-install ``plugins-contrib/<package>``, not editable, built from a copy in
    ``tmp_dir`` so the checkout gets no build litter."""
    import importlib
    import shutil
    import subprocess
    import sys

    src = tmp_dir / package
    shutil.copytree(CONTRIB / package, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", str(src)],
                   check=True, env=_pip_env())
    importlib.invalidate_caches()


def _pip_uninstall(package: str) -> None:
    import importlib
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", package], check=True, env=_pip_env())
    importlib.invalidate_caches()


def pip_install_contrib(package: str, entry: str, tmp_dir: Path):
    """pip-install ``plugins-contrib/<package>`` (not editable, built from a copy in
    ``tmp_dir`` so the checkout gets no build litter); yield the module its ``radixd`` entry
    point ``entry`` loads; uninstall afterwards unless it was installed before. A generator
    for session/module fixtures: ``yield from pip_install_contrib(...)``.

    Under pytest-xdist the controller has installed it the same way for the whole run
    (``pytest_configure`` below): a worker installing or uninstalling in the shared
    environment would do it under the other worker's daemons and CLIs loading entry points."""
    import importlib.metadata

    by_run = package in os.environ.get(CONTRIB_RUN_ENV, "").split(",")
    was_installed = _contrib_installed(package)
    if not by_run:
        _pip_install_copy(package, tmp_dir)
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="radixd")}
    assert entry in eps and eps[entry].value == package.replace("-", "_"), sorted(eps)
    yield eps[entry].load()
    if not by_run and not was_installed:
        _pip_uninstall(package)


def pytest_configure(config):
    """pytest-xdist's controller (``-n N``): the contrib packages pip-installed once before the
    workers start, for the whole run (see ``pip_install_contrib``); removed again at the end
    (``pytest_unconfigure``) unless they were installed before."""
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="radixd-contrib-"))
    config._radixd_contrib = installed = []
    for package in CONTRIB_ENTRIES:
        was_installed = _contrib_installed(package)
        try:
            _pip_install_copy(package, tmp)
        except Exception:  # noqa: BLE001 (that package's fixture installs it, and fails, as without xdist)
            continue
        installed.append((package, was_installed))
    os.environ[CONTRIB_RUN_ENV] = ",".join(p for p, _ in installed)


def pytest_unconfigure(config):
    for package, was_installed in getattr(config, "_radixd_contrib", []):
        if not was_installed:
            _pip_uninstall(package)
    os.environ.pop(CONTRIB_RUN_ENV, None)


@pytest.fixture(scope="session")
def redis_plugin(tmp_path_factory):
    """``plugins-contrib/radixd-redis`` pip-installed (``pip_install_contrib``); its module. Here
    and not in test_contrib_redis.py, so the session installs it once for every module using it
    (a fixture imported into another module is a second fixture, built a second time)."""
    yield from pip_install_contrib("radixd-redis", "redis", tmp_path_factory.mktemp("contrib"))


@pytest.fixture
def redis_server(tmp_path):
    """A throwaway ``redis-server`` on a free loopback port (``benchmarks.common.RedisServer``)."""
    import shutil

    from benchmarks.common import RedisServer

    server = RedisServer(shutil.which("redis-server"), tmp_path)
    yield server
    server.kill()


class SmgGateway:
    """SGLang's gateway (``smg launch``, the PyPI package ``smg``) on free loopback ports in
    front of ``worker_urls``, with one routing ``policy``; ready once every worker is registered
    and healthy."""

    def __init__(self, tmp: Path, worker_urls: list[str], policy: str, *extra: str, timeout: float = 60.0):
        import shutil
        import socket
        import subprocess
        import time

        import httpx

        exe = shutil.which("smg")
        if exe is None:
            pytest.skip("smg is not installed (pip install smg)")
        ports = []
        for _ in range(2):  # the router's and its Prometheus exporter's (default 29000, often taken)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.log_path = tmp / f"smg-{policy}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "launch", "--host", "127.0.0.1", "--port", str(ports[0]), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(ports[1]), "--policy", policy, "--worker-urls", *worker_urls, *extra],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
                if sum(w["is_healthy"] and w["status"] == "ready" for w in workers) == len(worker_urls):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"smg did not register its workers:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
