"""Atomic writes keep the modes a user expects: shared outputs what the umask gives, secrets their owner's alone."""

import errno
import os
import shutil
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


# --- folders replaced together ---------------------------------------------------------------------------------------
def _pair(tmp_path, tag):
    """Two folders to replace together (as a published folder and its keys folder), each holding ``tag``."""
    for name in ("pub", "pub-keys"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "what").write_text(tag)


def _state(tmp_path):
    return tuple((tmp_path / name / "what").read_text() if (tmp_path / name).is_dir() else None
                 for name in ("pub", "pub-keys"))


def _new_pair(tmp_path):
    news = {}
    for name in ("pub-keys", "pub"):
        news[tmp_path / name] = temp_sibling(tmp_path / name, "partial", folder=True)
        (news[tmp_path / name] / "what").write_text("new")
    return news


def _failing_replace(monkeypatch, at, persistent=False, error=OSError):
    """``os.replace`` failing at its ``at``-th call (and every later one where ``persistent``: a process killed
    there does nothing more); returns the list of the calls made."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == at or (persistent and len(calls) > at):
            raise error("injected")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_folders_are_replaced_together_whatever_step_fails(tmp_path, monkeypatch):
    """An error at any rename (moving a folder aside or in, writing the journal) leaves both old folders, and a process
    killed at any rename (nothing runs after it) leaves what the next command's recovery makes both old or both new:
    never the new keys beside the old published folder, never the old keys only in a hidden folder."""
    from modular.files import recover_folders, replace_folders, swap_folders

    _pair(tmp_path, "old")
    with monkeypatch.context() as m:
        calls = _failing_replace(m, at=0)
        replace_folders(_new_pair(tmp_path))
    assert _state(tmp_path) == ("new", "new") and sorted(p.name for p in tmp_path.iterdir()) == ["pub", "pub-keys"]
    steps = len(calls)
    assert steps >= 5  # the journal, two folders aside, two in (and the journal's last word)
    for at in range(1, steps + 1):
        for persistent, error in ((False, KeyboardInterrupt), (True, OSError)):
            _pair(tmp_path, "old")
            news = _new_pair(tmp_path)
            with monkeypatch.context() as m:
                _failing_replace(m, at, persistent, error)
                with pytest.raises(error):
                    replace_folders(news)
            if not persistent:  # recovered by the failing command itself: the old pair, and nothing left beside it
                assert _state(tmp_path) == ("old", "old"), at
            for folder in (tmp_path / "pub", tmp_path / "pub-keys"):  # the next command's recovery, from either one
                assert set(swap_folders(folder)) <= {tmp_path / "pub", tmp_path / "pub-keys"}
                recover_folders(folder)
            assert _state(tmp_path) in {("old", "old"), ("new", "new")}, (at, persistent, _state(tmp_path))
            for tmp in news.values():  # what the writer removes once its error reaches it
                shutil.rmtree(tmp, ignore_errors=True)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["pub", "pub-keys"], (at, persistent)


def test_a_full_disk_is_told_from_other_errors_and_named_with_the_space_needed(tmp_path):
    from modular.files import disk_full_error, is_disk_full

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("PytorchStreamWriter failed writing file data/0")
    wrapped.__context__ = full
    assert is_disk_full(full) and is_disk_full(wrapped) and is_disk_full(OSError(errno.EDQUOT, "quota"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(RuntimeError("x"))
    line = str(disk_full_error(tmp_path / "run", "the checkpoint last.ckpt", 3_400_000, "free some space"))
    assert line.startswith(f"no space left in {tmp_path / 'run'} for the checkpoint last.ckpt (it needs about 3.4 MB, ")
    assert "free there): free some space" in line and "\n" not in line
