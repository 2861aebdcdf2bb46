"""Shared fixtures: tiny random models of every supported architecture, built from configs."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The suite runs on pytest-xdist workers, one per core (addopts in pyproject.toml). Each worker and every process a
# test starts (training runs, commands) computes with cores / workers threads, set before torch starts its pool:
# tiny models gain nothing from more, and two workers' thread pools on two cores wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# lightning is imported while collecting, so that its log handlers write to the session's stderr: first imported by
# a test (nothing at collection may import it), they would keep that test's captured stream, closed after it
import lightning  # noqa: E402, F401
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core this process may use, at most 8 (each worker holds its own models)."""
    return max(1, min(_cpus(), 8))

D, LAYERS, HEADS, KV, FF, VOCAB = 64, 2, 4, 2, 128, 320


def _configs():
    import transformers as T

    common = dict(
        hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF, vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    gqa = dict(common, num_key_value_heads=KV)
    return {
        "llama": lambda: T.LlamaConfig(**gqa),
        "mistral": lambda: T.MistralConfig(**gqa),
        "qwen2": lambda: T.Qwen2Config(**gqa),
        "qwen3": lambda: T.Qwen3Config(**gqa, head_dim=D // HEADS),
        "olmo": lambda: T.OlmoConfig(**gqa),
        "olmo2": lambda: T.Olmo2Config(**gqa),
        "phi3": lambda: T.Phi3Config(**gqa, pad_token_id=0),
        "gemma": lambda: T.GemmaConfig(**gqa, head_dim=D // HEADS),
        "gemma2": lambda: T.Gemma2Config(**gqa, head_dim=D // HEADS),
        "gemma3_text": lambda: T.Gemma3TextConfig(**gqa, head_dim=D // HEADS),
        "gpt2": lambda: T.GPT2Config(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=128),
        "gpt_neox": lambda: T.GPTNeoXConfig(**common),
    }


ARCHS = list(_configs())


def make_tiny_model(arch: str, seed: int = 0):
    """A tiny random causal LM of architecture ``arch`` in eval mode, with non-trivial norm gains."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch](), dtype=torch.float32).eval()
    with torch.no_grad():  # random gains so that norm handling is actually exercised
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name.split(".")[-2:][0]:
                if p.ndim == 1 and name.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return make_tiny_model(arch)


@pytest.fixture
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 7), generator=g)


def make_tiny_tokenizer(vocab_size: int = VOCAB):
    """A small byte-level BPE tokenizer trained on the shipped behaviour texts, with a chat template."""
    import json
    from importlib import resources

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    res = resources.files("modular.data").joinpath("resources")
    texts = json.loads(res.joinpath("neutral_text.json").read_text())
    texts += json.loads(res.joinpath("retain_instructions.json").read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def save_tiny_folder(path, arch: str = "llama", seed: int = 0):
    """A tiny random model of ``arch`` with the tiny tokenizer, saved as a Hugging Face folder."""
    tok = make_tiny_tokenizer()
    model = make_tiny_model(arch, seed)
    model.config.vocab_size = VOCAB
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _no_shared_wandb_service():
    """A W&B service started in this test process (an in-process run logging offline) names itself in WANDB_SERVICE;
    a subprocess inheriting it would share it, and a run resumed there finds its id "in use". Every test starts
    without it and leaves without it."""
    os.environ.pop("WANDB_SERVICE", None)
    yield
    os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Keep reference/model caches of tiny-model tests out of the user's cache."""
    monkeypatch.setenv("MODULAR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def kv_caches(monkeypatch):
    """Counts key-value caches: ``built = kv_caches(model)`` is a list that grows by one for every cache built from
    then on (the count is first checked to see ``model``'s own: a plain forward of it builds one). A forward that
    decodes nothing should build none: a cache holds every block's keys and values until the outputs are dropped."""
    from transformers import cache_utils

    built = []
    init = cache_utils.DynamicCache.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counted)

    def start(model) -> list:
        with torch.no_grad():
            model(input_ids=torch.ones(1, 3, dtype=torch.long, device=next(model.parameters()).device))
        assert built, "the count does not see the model's cache"
        built.clear()
        return built

    return start


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """A cache the tests of one worker share: reference outputs are keyed by the model's content, so the runs of
    every test on the same tiny model (the same architecture and seed) compute them once."""
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture
def tiny_env(request, shared_cache):
    """Environment of a subprocess on tiny models: W&B offline, the shared cache (the test's isolated cache where it
    asks for one, to look at what was cached), and its own W&B service (a service this test process started, named
    by WANDB_SERVICE, would hold every run id a subprocess used)."""
    cache = request.getfixturevalue("isolated_cache") if "isolated_cache" in request.fixturenames else shared_cache
    env = dict(os.environ, WANDB_MODE="offline", MODULAR_CACHE=str(cache))
    env.pop("WANDB_SERVICE", None)
    return env


def describe_figure(fig) -> dict:
    """What a matplotlib figure draws: per axes its title, axis labels, tick labels, line labels and lengths,
    bar heights and widths, texts (annotations) and legend entries; the figure's suptitle."""
    from matplotlib.patches import Rectangle

    axes = []
    for ax in fig.axes:
        legend = ax.get_legend()
        axes.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
            "yticklabels": [t.get_text() for t in ax.get_yticklabels()],
            "lines": {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()},
            "bars": [p.get_height() for p in ax.patches if isinstance(p, Rectangle)],
            "widths": [p.get_width() for p in ax.patches if isinstance(p, Rectangle)],  # a horizontal bar's value
            "texts": [t.get_text() for t in ax.texts],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            "images": len(ax.images) + sum(1 for c in ax.collections if c.get_array() is not None),
            "points": [[tuple(xy) for xy in line.get_xydata()] for line in ax.get_lines() if line.get_marker() == "o"],
        })
    suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
    return {"suptitle": suptitle, "axes": axes}


@pytest.fixture
def drawn(monkeypatch):
    """What every figure saved during the test draws (:func:`describe_figure`), by file name."""
    from pathlib import Path

    from matplotlib.figure import Figure

    seen: dict[str, dict] = {}
    real = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        seen[Path(str(fname)).name] = describe_figure(self)
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def basic_terms() -> list:
    """The lock's plain terms at their default weights: a tiny test module's recipe where a test names none (the
    shipped recipe is the default config's, modular/configs/gate_capitals_smollm2.yaml)."""
    from modular.gating.objectives import BehaviourAnswer, KeepReference, LMText, LockedState, TaskAnswer

    return [BehaviourAnswer(), LockedState(), KeepReference(), LMText(), TaskAnswer()]
