"""Corrupt model inputs: one line naming the file and what to do, from the library and from the CLIs."""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from modular import ModularError
from modular.app.cli import main
from modular.models.loading import load_model, load_tokenizer
from modular.runs import Run, load_open_model
from tests.conftest import save_tiny_folder


def _truncated_gguf(path):
    """A real GGUF file (header, metadata, one tensor) cut inside its metadata."""
    import gguf
    import numpy as np

    whole = path.with_name("whole.gguf")
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(whole.read_bytes()[:100])
    return path


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_corrupt_gguf_is_one_line(tmp_path, isolated_cache, kind):
    path = tmp_path / "x.gguf"
    if kind == "random":
        path.write_bytes(os.urandom(4096))
    else:
        _truncated_gguf(path)
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModularError, match=r"x\.gguf is not a readable GGUF file .*re-download or re-convert"):
            load(str(path))
    assert not (isolated_cache / "models").exists() or not any((isolated_cache / "models").iterdir())


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_junk_safetensors_name_the_file(tmp_path, capsys, kind):
    folder = save_tiny_folder(tmp_path / "tiny", "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(5000) if kind == "random" else weights.read_bytes()[:2000])
    with pytest.raises(ModularError, match=r"model\.safetensors is not a readable safetensors file .*re-download"):
        load_model(str(folder))
    assert main(["inspect", str(folder)]) == 2  # the CLI: one line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "model.safetensors" in err[-1] and "Traceback" not in "\n".join(err)


def test_truncated_run_checkpoint_is_one_line(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(1000)}}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:1500])
    run = Run(tmp_path, "unused", [], {}, {"checkpoint": str(ckpt)})
    with pytest.raises(ModularError, match=r"last\.ckpt is not a readable checkpoint .*--ckpt_path null"):
        load_open_model(run)


def test_gguf_conversion_cache_is_named_by_content(tmp_path, isolated_cache):
    """The same GGUF file in two environments (two clones' .venv) shares one conversion; other bytes do not."""
    from modular.models.cache import _gguf_cache_folder

    a, b, c = (tmp_path / d / "m.gguf" for d in ("one", "two", "three"))
    for path, content in ((a, b"same bytes"), (b, b"same bytes"), (c, b"other bytes")):
        path.parent.mkdir()
        path.write_bytes(content)
    assert _gguf_cache_folder(a, "m") == _gguf_cache_folder(b, "m") != _gguf_cache_folder(c, "m")
    assert _gguf_cache_folder(a, "m").parent == isolated_cache / "models"
    a.write_bytes(b"changed bytes")  # a file changed in place is converted again
    assert _gguf_cache_folder(a, "m") != _gguf_cache_folder(b, "m")


def test_a_conversion_another_process_finished_first_is_kept(tmp_path, isolated_cache, monkeypatch):
    """Two processes converting one GGUF file at once (two test workers, two jobs on a fresh cache): the one whose
    rename comes second finds the folder in place, keeps it and removes its own copy; no traceback, no leftovers."""
    import transformers

    from modular.models import resolve
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: make_tiny_model("llama"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: make_tiny_tokenizer())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"stands for a GGUF file")
    out = isolated_cache / "models" / "m-0123456789ab"
    replace = os.replace

    def the_other_process_first(src, dst):
        if Path(dst) == out:
            save_tiny_folder(out, seed=1)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", the_other_process_first)
    resolve._convert_gguf(gguf, out)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # the temporary copy removed
    assert not (out / "SOURCE").exists()  # the other process's folder, kept as it was


@pytest.mark.parametrize("dtype", ["auto", None, "float16"])
def test_load_dtype_is_the_precision_load_model_loads_in(tmp_path, dtype):
    """Read from the config alone (for cache keys), it must agree with the weights ``load_model`` returns."""
    from transformers import AutoModelForCausalLM

    from modular.models.loading import load_dtype

    folder = save_tiny_folder(tmp_path / "m")
    AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)  # declares bfloat16
    expected = {"auto": torch.float32, None: torch.bfloat16, "float16": torch.float16}[dtype]  # on the CPU
    assert load_dtype(folder, dtype, "cpu") == expected
    assert next(load_model(folder, dtype, "cpu").parameters()).dtype == expected


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto", None])
def test_empty_model_is_the_loaded_model_without_its_weights(tmp_path, arch, dtype):
    """``empty_model`` (a process that receives its weights from another): the modules, names, shapes, precision
    and tied weights of ``load_model``'s model, on the meta device, with no weight file read."""
    from modular.models.loading import empty_model

    folder = save_tiny_folder(tmp_path / "m", arch)
    loaded = load_model(folder, dtype, "cpu")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()  # nothing to read
    empty = empty_model(folder, dtype, "cpu")
    assert all(p.is_meta for p in empty.parameters()) and all(b.is_meta for b in empty.buffers())
    full, meta = loaded.state_dict(), empty.state_dict()
    assert full.keys() == meta.keys()
    assert all((full[k].shape, full[k].dtype) == (meta[k].shape, meta[k].dtype) for k in full)
    assert [n for n, _ in loaded.named_buffers()] == [n for n, _ in empty.named_buffers()]
    tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert tied == (empty.get_output_embeddings().weight is empty.get_input_embeddings().weight)
    assert tied == (arch == "gemma")
    assert not empty.training


def _settled(folder, age_s: int = 3600):
    """``folder`` with every file's modification time ``age_s`` in the past: a model saved long ago, whose digests
    may be kept (one written a moment ago may still be changing within its time's resolution)."""
    for file in folder.iterdir():
        st = file.stat()
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns - age_s * 10**9))
    return folder


def _flip_last_byte(path):
    """Other bytes of the same size, written in place."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_a_models_fingerprint_is_its_content(tmp_path, isolated_cache):
    """Two copies of one model (a second clone's, a published folder) share a fingerprint, whatever their paths;
    other weights, tokenizer, chat template or config at the same path do not: a reference computed from the old
    files must not be read back for the new ones."""
    from modular.models.resolve import model_fingerprint

    a = save_tiny_folder(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "another" / "clone" / "b")
    assert model_fingerprint(str(a)) == model_fingerprint(b) == model_fingerprint(str(_settled(b)))
    assert str(tmp_path) not in model_fingerprint(a)
    seen = {model_fingerprint(a)}
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "config.json",
                 "generation_config.json"):
        _flip_last_byte(a / name)  # same size, at once: no stale digest is kept for a file just written
        assert model_fingerprint(a) not in seen, name
        seen.add(model_fingerprint(a))
    assert model_fingerprint(save_tiny_folder(tmp_path / "c", seed=1)) not in seen | {model_fingerprint(b)}


def test_file_digests_are_kept_on_disk_while_size_and_times_stay(tmp_path, isolated_cache, monkeypatch):
    """A large model is hashed once per file, not once per run: the digests are kept in the cache by absolute path,
    size and times, and a file whose size or time changed is hashed again (alone)."""
    import modular.models.cache as cache
    from modular.models.resolve import model_fingerprint

    folder = _settled(save_tiny_folder(tmp_path / "m"))
    hashed = []
    sha256 = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda path: hashed.append(Path(path).name) or sha256(path))
    first = model_fingerprint(folder)
    assert "model.safetensors" in hashed and "config.json" in hashed
    index = json.loads((isolated_cache / "digests.json").read_text())
    assert str((folder / "model.safetensors").resolve()) in index
    hashed.clear()
    assert model_fingerprint(folder) == first and hashed == []  # read from disk: no file read again

    weights = folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new time, the same bytes
    assert model_fingerprint(folder) == first and hashed == ["model.safetensors"]
    hashed.clear()
    assert model_fingerprint(folder) == first and hashed == []
    st = weights.stat()
    time.sleep(0.05)  # past the file system's time resolution
    _flip_last_byte(weights)  # the same size, its old time restored (cp -p, rsync -t): its change time tells
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    second = model_fingerprint(folder)
    assert second != first and hashed == ["model.safetensors"]
    hashed.clear()
    weights.write_bytes(weights.read_bytes() + b"\0")  # another size, its old time restored
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(folder) not in (first, second) and hashed == ["model.safetensors"]

    (isolated_cache / "digests.json").write_text("{not json")  # a damaged memo is rebuilt, not a traceback
    hashed.clear()
    third = model_fingerprint(folder)
    assert "model.safetensors" in hashed and model_fingerprint(folder) == third
    assert str(weights.resolve()) in json.loads((isolated_cache / "digests.json").read_text())


def test_a_file_written_a_moment_ago_is_not_memoised(tmp_path, isolated_cache, monkeypatch):
    """Rewritten within its time's resolution, a file could keep its size and time: its digest is kept only once
    its time is past."""
    import modular.models.cache as cache
    from modular.models.resolve import model_fingerprint

    folder = save_tiny_folder(tmp_path / "m")
    hashed = []
    sha256 = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda path: hashed.append(Path(path).name) or sha256(path))
    model_fingerprint(folder)
    model_fingerprint(folder)
    assert hashed.count("model.safetensors") == 2


def test_a_gguf_conversion_is_keyed_by_the_gguf_files_digest(tmp_path, monkeypatch):
    """The conversion folder of a built-in alias or a .gguf file is named by the GGUF file's SHA-256: its fingerprint
    is that digest, whatever the cache's path ($MODULAR_CACHE) or the venv the GGUF file is installed in, and its
    files are not hashed again. A folder of the same name elsewhere is hashed like any other."""
    import modular.models.cache as cache
    from modular.models.resolve import model_fingerprint

    hashed = []
    sha256 = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda path: hashed.append(Path(path).name) or sha256(path))
    fingerprints = []
    for n, alias in enumerate(("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1")):
        monkeypatch.setenv("MODULAR_CACHE", str(tmp_path / f"cache{n}"))
        gguf = tmp_path / f"venv{n}" / "site-packages" / "x.gguf"
        gguf.parent.mkdir(parents=True)
        gguf.write_bytes(b"the same GGUF bytes")
        folder = cache._gguf_cache_folder(gguf, alias)
        save_tiny_folder(folder, seed=n)  # a stand-in for the conversion: other weights, to show they are not read
        (folder / "SOURCE").write_text(f"{gguf}\n")
        hashed.clear()
        fingerprints.append(model_fingerprint(str(folder)))
        assert hashed == []
    digest = hashlib.sha256(b"the same GGUF bytes").hexdigest()
    assert fingerprints[0] == fingerprints[1] and digest[:12] in fingerprints[0]
    elsewhere = shutil.copytree(folder, tmp_path / "copied" / folder.name)
    assert model_fingerprint(elsewhere) != fingerprints[0] and "model.safetensors" in hashed


def test_a_hub_ids_fingerprint_is_the_id_and_its_cached_revision(tmp_path, monkeypatch):
    """A hub id is not hashed: its fingerprint is the id, with the commit the local hub cache resolves it to where
    it holds one (read offline)."""
    from huggingface_hub import constants

    from modular.models.resolve import model_fingerprint

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_fingerprint("org/model") == "hub:org/model"
    repo = tmp_path / "hub" / "models--org--model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert model_fingerprint("org/model") == f"hub:org/model@{commit}"


def test_hub_origin_is_each_aliases_hub_model_and_licence_and_what_a_reference_names(tmp_path, monkeypatch):
    """A published card's base_model and license (read offline): a built-in alias's own, a hub id itself (with an
    alias's licence, or its cached card's), a local folder's config ``_name_or_path`` and its README's licence, a hub
    cache snapshot's model; nothing where nothing names a hub model."""
    from huggingface_hub import constants

    from modular.models.aliases import ALIASES, HubOrigin, hub_origin

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_origin("smollm2-135m-instruct") == HubOrigin("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert hub_origin("gemma3-270m") == HubOrigin("google/gemma-3-270m", "gemma")
    assert all(a.hub_id.count("/") == 1 and a.license for a in ALIASES.values())
    assert hub_origin("HuggingFaceTB/SmolLM2-135M-Instruct").license == "apache-2.0"
    assert hub_origin("org/model") == HubOrigin("org/model", None)
    repo = tmp_path / "hub" / "models--org--model"  # a card in the local hub cache gives its licence
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "README.md").write_text("---\nlicense: mit\n---\n# card\n")
    assert hub_origin("org/model") == HubOrigin("org/model", "mit")
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert hub_origin(repo / "snapshots" / commit) == HubOrigin("org/model", "mit")  # the snapshot folder itself

    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "someone/base"}))
    assert hub_origin(folder) == HubOrigin("someone/base", None)
    (folder / "README.md").write_text("---\nlicense: cc-by-4.0\ntags: [x]\n---\n\nA model.\n")
    assert hub_origin(folder) == HubOrigin("someone/base", "cc-by-4.0")
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "gemma3-270m"}))
    assert hub_origin(folder) == HubOrigin("google/gemma-3-270m", "cc-by-4.0")  # the folder's own card first
    (folder / "README.md").unlink()
    assert hub_origin(folder) == HubOrigin("google/gemma-3-270m", "gemma")
    for name in ("/home/me/models/base", "base", "", None):  # a path, a plain name, none: no base_model
        (folder / "config.json").write_text(json.dumps({"_name_or_path": name}))
        assert hub_origin(folder) == HubOrigin(), name
    assert hub_origin(tmp_path / "missing.gguf") == HubOrigin() and hub_origin("tiny") == HubOrigin()
