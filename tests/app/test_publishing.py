"""``modular publish --push_to_hub``: the published folder uploaded through huggingface_hub (mocked: no network),
refused in one line before anything is written where no upload could be made."""

from pathlib import Path

import pytest
import torch

from modular.app import cli
from tests.conftest import D, save_tiny_folder


class _Hub:
    """A stand-in for huggingface_hub.HfApi: the calls made, each as (name, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        return self

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))

    def upload_folder(self, *args, **kwargs):
        self.calls.append(("upload_folder", args, kwargs))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"})()


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A gated run whose lock training verified, on a tiny local model (its record, checkpoint and weights stand-ins:
    no training)."""
    import modular.runs
    from modular.models import load_model

    base = save_tiny_folder(tmp_path / "tiny")
    folder = tmp_path / "run"
    folder.mkdir()
    direction = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    record = {"lock": {"step": 5, "reached": True}}
    monkeypatch.setattr(modular.runs, "read_run",
                        lambda path: modular.runs.Run(Path(path), str(base), ["capitals"], {"capitals": direction},
                                                      record))
    monkeypatch.setattr(modular.runs, "checkpoint_step", lambda r: 5)
    monkeypatch.setattr(modular.runs, "load_open_model",
                        lambda r, dtype=None, device=None: load_model(r.model_name, dtype=None, device="cpu"))
    return folder


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    fake = _Hub()
    monkeypatch.setattr(huggingface_hub, "HfApi", fake)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    return fake


def test_publish_pushes_the_published_folder_to_the_hub(tmp_path, run, hub, capsys):
    out = tmp_path / "pub"
    assert cli.main(["publish", "--run", str(run), "--out", str(out), "--push_to_hub", "user/locked-tiny",
                     "--private", "true"]) == 0
    assert (out / "README.md").is_file() and (tmp_path / "pub-keys" / "capitals.key.safetensors").is_file()
    (create, c_args, c_kw), (upload, _, u_kw) = hub.calls
    assert (create, c_args, c_kw["exist_ok"], c_kw["private"]) == ("create_repo", ("user/locked-tiny",), True, True)
    assert (upload, u_kw["repo_id"], Path(u_kw["folder_path"])) == ("upload_folder", "user/locked-tiny", out)
    assert "uploaded: https://huggingface.co/user/locked-tiny/commit/abc" in capsys.readouterr().out


def test_publish_without_a_token_is_refused_before_anything_is_written(tmp_path, run, hub, monkeypatch, capsys):
    from huggingface_hub.utils import _headers

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(_headers, "get_token", lambda: None)
    out = tmp_path / "pub"
    assert cli.main(["publish", "--run", str(run), "--out", str(out), "--push_to_hub", "user/name"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot upload to the Hugging Face hub: Token is required") and "\n" not in err
    assert not out.exists() and not (tmp_path / "pub-keys").exists() and hub.calls == []


def test_publish_refuses_to_push_a_folder_that_holds_a_key(tmp_path, run, hub, monkeypatch, capsys):
    """A published folder never holds a key; were one to get there (here: written with the model), nothing is
    uploaded."""
    import shutil

    import modular.publish

    publish = modular.publish.publish_model

    def with_a_key(*args, **kwargs):
        folder, keys = publish(*args, **kwargs)
        shutil.copy(keys / "capitals.key.safetensors", folder / "stray.safetensors")
        return folder, keys

    monkeypatch.setattr(modular.publish, "publish_model", with_a_key)
    assert cli.main(["publish", "--run", str(run), "--out", str(tmp_path / "pub"), "--push_to_hub", "user/name"]) == 2
    assert "holds the key file stray.safetensors; keys are never uploaded" in capsys.readouterr().err
    assert hub.calls == []


def test_publish_help_documents_the_upload(capsys):
    with pytest.raises(SystemExit):
        cli.main(["publish", "--help"])
    text = capsys.readouterr().out
    assert "--push_to_hub" in text and "hf upload user/name" in text and "--private" in text
