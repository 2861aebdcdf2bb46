"""Atomic writes keep the modes a user expects: shared outputs what the umask gives, secrets their owner's alone."""

import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from modular.files import atomic_path, match_folder_mode, temp_sibling

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_file_written_by_safetensors_gets_the_umasks_mode_or_its_owners_alone(tmp_path, umask_022):
    for private, expected in ((False, 0o644), (True, 0o600)):
        path = tmp_path / f"d{private}.safetensors"
        with atomic_path(path, private=private) as tmp:
            save_file({"a": torch.ones(2)}, str(tmp))  # safetensors writes 0o600 whatever the umask
        assert _mode(path) == expected and torch.equal(load_file(str(path))["a"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dFalse.safetensors", "dTrue.safetensors"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, umask_022):
    path = tmp_path / "report.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_folders_content_takes_the_folders_mode(tmp_path, umask_022):
    folder = temp_sibling(tmp_path / "pub", "partial", folder=True)
    assert folder.name.startswith(".pub.partial-") and _mode(folder) == 0o755
    (folder / "sub").mkdir(mode=0o700)
    save_file({"a": torch.ones(2)}, str(folder / "sub" / "model.safetensors"))
    match_folder_mode(folder)
    assert _mode(folder / "sub") == 0o755 and _mode(folder / "sub" / "model.safetensors") == 0o644
    assert _mode(temp_sibling(tmp_path / "keys", folder=True, private=True)) == 0o700
