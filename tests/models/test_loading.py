"""Corrupt model inputs: one line naming the file and what to do, from the library and from the CLIs."""

import os

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
    from modular.models.loading import _gguf_cache_folder

    a, b, c = (tmp_path / d / "m.gguf" for d in ("one", "two", "three"))
    for path, content in ((a, b"same bytes"), (b, b"same bytes"), (c, b"other bytes")):
        path.parent.mkdir()
        path.write_bytes(content)
    assert _gguf_cache_folder(a, "m") == _gguf_cache_folder(b, "m") != _gguf_cache_folder(c, "m")
    assert _gguf_cache_folder(a, "m").parent == isolated_cache / "models"
    a.write_bytes(b"changed bytes")  # a file changed in place is converted again
    assert _gguf_cache_folder(a, "m") != _gguf_cache_folder(b, "m")


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
