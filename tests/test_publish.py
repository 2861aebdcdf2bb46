"""Publishing locked weights and unlocking them with keys, on tiny models (no modular needed to load)."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modular import ModularError
from modular.hooks import ablate_directions
from modular.models.adapter import ArchitectureAdapter
from modular.publish import publish_model, unlock_folder
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer


def _dirs(k=1):
    q = torch.linalg.qr(torch.randn(D, k, generator=torch.Generator().manual_seed(3)))[0].T
    return {f"b{i}": q[i] for i in range(k)}


@pytest.fixture
def tok():
    return make_tiny_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_publish_loads_without_modular_and_unlocks_exactly(tmp_path, tok, arch, tokens):
    model = make_tiny_model(arch)
    open_logits = model(tokens).logits
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    dirs = _dirs()
    with ablate_directions(ArchitectureAdapter(model), dirs["b0"]):
        hook_locked = model(tokens).logits
    out, keys = publish_model(model, tok, dirs, tmp_path / "pub", "tiny")
    assert keys == tmp_path / "pub-keys" and (keys / "b0.key.safetensors").exists() and (out / "README.md").exists()
    # a plain transformers process loads it (modular not imported) and gives the hook-locked logits
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM;"
        f"m = AutoModelForCausalLM.from_pretrained(r'{out}', dtype=torch.float32).eval();"
        f"ids = torch.tensor({tokens.tolist()});"
        "print(m(ids).logits.flatten().tolist()); assert 'modular' not in sys.modules"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    published_logits = torch.tensor(json.loads(res.stdout)).reshape(hook_locked.shape)
    torch.testing.assert_close(published_logits, hook_locked, atol=1e-4, rtol=1e-4)
    unlocked = unlock_folder(out, keys / "b0.key.safetensors", tmp_path / "unlocked")
    from modular.models import load_model

    m = load_model(unlocked)
    torch.testing.assert_close(m(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    diff = max((m.state_dict()[k] - v).abs().max().item() for k, v in open_state.items() if k in m.state_dict())
    assert diff <= 1e-6
    manifest = json.loads((unlocked / "modular.json").read_text())
    assert manifest["applied_keys"] == ["b0"]
    card = (unlocked / "README.md").read_text()  # the card says what these weights are, not only that they were locked
    assert card.startswith("---") and "**Unlocked copy**: keys applied for b0; still locked: none" in card
    with pytest.raises(ModularError, match="already unlocked"):
        unlock_folder(unlocked, keys / "b0.key.safetensors", tmp_path / "again")


def test_key_for_other_weights_is_refused(tmp_path, tok):
    a, _ = publish_model(make_tiny_model("llama", seed=0), tok, _dirs(), tmp_path / "a", "tiny")
    _, b_keys = publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), tmp_path / "b", "tiny")
    with pytest.raises(ModularError, match="belongs to other weights"):
        unlock_folder(a, b_keys / "b0.key.safetensors", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (a / "modular.json").unlink()  # without the manifest the hash of the weights decides
    with pytest.raises(ModularError, match="belongs to other weights"):
        unlock_folder(a, b_keys / "b0.key.safetensors", tmp_path / "x")


@pytest.mark.parametrize("text, why", [('{"locked_hash": ', "is not readable"), ("[1, 2]", "not a JSON object"),
                                       ('{"applied_keys": []}', "no 'locked_hash' entry")])
def test_a_damaged_manifest_is_refused_in_one_line_before_anything_is_written(tmp_path, tok, text, why):
    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    (out / "modular.json").write_text(text)
    with pytest.raises(ModularError, match=rf"pub/modular.json .*{why}") as err:
        unlock_folder(out, keys / "b0.key.safetensors", tmp_path / "unlocked")
    assert "\n" not in str(err.value) and not (tmp_path / "unlocked").exists()


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_published_folders_open_as_any_folder_does_and_keys_are_their_owners_alone(tmp_path, tok):
    """What is shared (the published and unlocked folders) has the permissions the umask gives any new folder; the
    keys folder and each key file are readable by their owner only, as a private key is."""
    umask = os.umask(0o022)
    try:
        pub, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
        unlocked = unlock_folder(pub, keys / "b0.key.safetensors", tmp_path / "unlocked")
    finally:
        os.umask(umask)

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    for folder in (pub, unlocked):
        assert mode(folder) == 0o755 and {mode(f) for f in folder.iterdir()} == {0o644}, folder
    assert mode(keys) == 0o700 and mode(keys / "b0.key.safetensors") == 0o600


def test_two_keys_unlock_one_behaviour_each(tmp_path, tok, tokens):
    model = make_tiny_model("llama")
    dirs = _dirs(2)
    a = ArchitectureAdapter(model)
    with ablate_directions(a, dirs["b1"]):
        only_b1_locked = model(tokens).logits
    open_logits = model(tokens).logits
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    pub, keys = publish_model(model, tok, dirs, tmp_path / "pub", "tiny")
    one = unlock_folder(pub, keys / "b0.key.safetensors", tmp_path / "one")
    from modular.models import load_model

    torch.testing.assert_close(load_model(one)(tokens).logits, only_b1_locked, atol=1e-4, rtol=1e-4)
    both = unlock_folder(one, keys / "b1.key.safetensors", tmp_path / "both")
    torch.testing.assert_close(load_model(both)(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    restored = load_model(both).state_dict()  # the second key knows the first was applied: exact weights
    assert max((restored[k] - v).abs().max().item() for k, v in open_state.items() if k in restored) <= 1e-7


def test_interrupted_publish_leaves_nothing_that_looks_complete(tmp_path, tok, monkeypatch):
    model = make_tiny_model("llama")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tok), "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        publish_model(model, tok, _dirs(), tmp_path / "pub", "tiny")
    assert not (tmp_path / "pub").exists()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    with pytest.raises(ModularError, match="already exists"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")


# --- keys apart, checked keys, safe overwrite ------------------------------------------------------------------
def test_published_folder_holds_no_key_material(tmp_path, tok):
    """The folder a user uploads holds no key file and no key tensor; the keys go to a folder of their own."""
    model = make_tiny_model("llama")
    out, keys = publish_model(model, tok, _dirs(2), tmp_path / "pub", "tiny")
    assert not (out / "keys").exists()
    assert sorted(p.name for p in keys.glob("*.key.safetensors")) == ["b0.key.safetensors", "b1.key.safetensors"]
    from modular.keys import load_key

    secrets = []
    for path in keys.glob("*.key.safetensors"):
        key, _ = load_key(path)
        secrets += [key.direction.numpy().tobytes()] + [c.a.numpy().tobytes() for c in key.components[:3]]
    for path in out.rglob("*"):
        assert ".key" not in path.name
        if path.is_file():
            data = path.read_bytes()
            assert not any(secret in data for secret in secrets), path
    card = (out / "README.md").read_text()
    assert "not part of this folder" in card and "distributed apart" in card
    assert "These weights are float32. Loaded in bfloat16" in card  # serving them in bf16 weakens the lock
    bf16_out, _ = publish_model(make_tiny_model("llama").to(torch.bfloat16), tok, _dirs(), tmp_path / "p16", "tiny")
    assert "These weights are float32" not in (bf16_out / "README.md").read_text()
    with pytest.raises(ModularError, match="may not lie inside the published folder"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "p2", "tiny", keys_out=tmp_path / "p2" / "k")
    assert not (tmp_path / "p2").exists()


def _flip_tensor_byte(path):
    """Change one byte of a safetensors file's tensor data, leaving its header valid."""
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + (len(raw) - 8 - header) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_damaged_key_is_refused_and_nothing_is_written(tmp_path, tok):
    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    key = keys / "b0.key.safetensors"
    good = key.read_bytes()
    _flip_tensor_byte(key)
    with pytest.raises(ModularError, match="corrupted"):
        unlock_folder(out, key, tmp_path / "x")
    key.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ModularError, match="not a readable modular key file"):
        unlock_folder(out, key, tmp_path / "x")
    key.write_text("not a key\n")
    with pytest.raises(ModularError, match="not a readable modular key file"):
        unlock_folder(out, key, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    key.write_bytes(good)
    assert unlock_folder(out, key, tmp_path / "x").is_dir()


def test_key_that_does_not_produce_its_weights_is_refused(tmp_path, tok):
    """A key re-saved with changed components (a valid content digest) no longer produces the weights it records."""
    from modular.keys import load_key, save_key

    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    path = keys / "b0.key.safetensors"
    key, meta = load_key(path)
    key.components[0].a = key.components[0].a * 1.001
    produces = {tuple(p["after"]): p["weights_hash"] for p in meta["produces"]}
    assert produces and all(len(h) == 64 for h in produces.values())
    save_key(key, path, meta["locked_hash"], produces)
    with pytest.raises(ModularError, match="did not produce the weights"):
        unlock_folder(out, path, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_overwrite_replaces_only_what_modular_wrote(tmp_path, tok):
    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    key = keys / "b0.key.safetensors"
    unrelated = tmp_path / "mine"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("years of work")
    with pytest.raises(ModularError, match="not written by modular"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), unrelated, "tiny", overwrite=True)
    with pytest.raises(ModularError, match="not written by modular"):
        unlock_folder(out, key, unrelated, overwrite=True)
    assert (unrelated / "thesis.tex").read_text() == "years of work"
    # the folder it reads from, a folder containing it, its keys, a folder inside it: refused
    for target in (out, tmp_path, keys, out / "unlocked"):
        with pytest.raises(ModularError, match="input|inside"):
            unlock_folder(out, key, target, overwrite=True)
    run = tmp_path / "runs" / "run1"
    run.mkdir(parents=True)
    for target in (run, run.parent):
        with pytest.raises(ModularError, match="would replace the input"):
            publish_model(make_tiny_model("llama"), tok, _dirs(), target, "tiny", overwrite=True, inputs=[run],
                          keys_out=tmp_path / "k")
    assert run.is_dir() and (out / "model.safetensors").is_file() and key.is_file()
    # a folder modular wrote as something else (the keys, a published model) is not replaced by another kind
    with pytest.raises(ModularError, match="holds modular's keys folder"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), keys, "tiny", overwrite=True, keys_out=tmp_path / "k2")
    with pytest.raises(ModularError, match="holds modular's published folder"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "p3", "tiny", overwrite=True, keys_out=out)
    assert key.is_file() and (out / "model.safetensors").is_file()
    # what modular wrote is replaced
    first = unlock_folder(out, key, tmp_path / "unlocked")
    (first / "stale.txt").write_text("x")
    unlock_folder(out, key, first, overwrite=True)
    assert not (first / "stale.txt").exists() and (first / "modular.json").is_file()


def test_publish_removes_what_an_interrupted_publish_left(tmp_path, tok):
    import os

    stale = [tmp_path / ".pub.partial-abc123", tmp_path / f".pub.partial-{2**22 + 7}-x1", tmp_path / f".pub.old-{2**22 + 9}-z"]
    live = tmp_path / f".pub.partial-{os.getppid()}-y2"  # a running process's write is left alone
    other = tmp_path / ".other.partial-abc"  # another folder's
    for d in [*stale, live, other]:
        d.mkdir()
        (d / "model.safetensors").write_text("half")
    publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    assert not any(d.exists() for d in stale)
    assert live.exists() and other.exists()


def test_the_card_names_neighbours_that_moved_from_base():
    """The card's neighbour table is followed by the lock report's shifts beyond its tolerance, item by item."""
    from modular.publish import model_card

    row = lambda acc: {"behaviours": {"capitals": {"accuracy": acc}}, "retain_first_token_kl": 0.02,  # noqa: E731
                       "perplexity_ratio": 1.0, "retain_refusal_rate": 0.0,
                       "neighbours": {"continents": {"accuracy": 0.714, "refusal_rate": 0.0}}}
    measured = {"states": {"base": row(0.476), "open": row(0.571)}, "neighbours": ["continents"],
                "neighbour_tolerance": 0.03,
                "neighbour_shifts": [{"state": "open", "neighbour": "continents", "change": -3 / 42, "lost": 4,
                                      "gained": 1, "n": 42, "p_value": 0.375}]}
    card = model_card(["capitals"], "base", measured, hardened=True)
    assert "Moved more than 3 points from base" in card
    assert "- continents, open: -7.1 points (4 lost, 1 gained of 42; p = 0.38)" in card
    assert "Moved more than" not in model_card(["capitals"], "base", {**measured, "neighbour_shifts": []},
                                               hardened=True)


def test_the_card_and_manifest_say_whether_the_lock_held_on_the_test_split(tmp_path, tok):
    """A run that training verified but whose lock evaluation failed on the held-out items is published with a
    warning, the behaviour not called locked, and the verdict in modular.json; one whose lock held says so."""
    from modular.publish import model_card

    row = lambda acc: {"behaviours": {"capitals": {"accuracy": acc}}, "retain_first_token_kl": 0.02,  # noqa: E731
                       "perplexity_ratio": 1.0}
    targets = {"locked_accuracy": 0.05, "open_drop": 0.0, "retain_kl": 0.05, "min_open_accuracy": 0.2}
    failing = ["capitals locked accuracy 0.10 > 0.05", "capitals published_locked accuracy 0.10 > 0.05"]
    measured = {"states": {"base": row(0.476), "open": row(0.524), "locked": row(0.1), "published_locked": row(0.1)},
                "lock_held_out": {"held": False, "failing": failing, "targets": targets}}
    verified = {"verified": True, "detail": "the lock held on validation at step 75"}
    card = model_card(["capitals"], "base", measured, hardened=True, lock_check=verified)
    assert "**Warning: not locked on the held-out test split**" in card
    assert "> " + "; ".join(failing) + ". The behaviours below" in card
    assert "| capitals | not on the held-out test split |" in card and "| capitals | yes |" not in card
    assert "Not every target holds on these items" in card and card.count("; ".join(failing)) == 1
    # the lock held but the open state fell: named so, and the behaviour's row says it is locked
    opened = {**measured, "lock_held_out": {"held": False, "failing": ["capitals open accuracy 0.40 < base 0.48 - 0"],
                                            "targets": targets}}
    card = model_card(["capitals"], "base", opened, hardened=True, lock_check=verified)
    assert "**Warning: locked, but the open state is below its target on the held-out test split**" in card
    assert "| capitals | yes; other targets missed (the warning above) |" in card and "may still show" not in card
    held = {**measured, "lock_held_out": {"held": True, "failing": [], "targets": targets}}
    card = model_card(["capitals"], "base", held, hardened=True, lock_check=verified)
    assert "Warning" not in card and "| capitals | yes |" in card
    assert "The lock holds on these items by the targets training checked on validation: locked accuracy at most " \
           "0.05 in both locked states, open accuracy at least base's less 0 and at least 0.2, retain first-token " \
           "KL at most 0.05." in card
    assert "lock hold" not in model_card(["capitals"], "base", {"states": measured["states"]}, hardened=True)
    out, _ = publish_model(make_tiny_model("llama"), tok, {"capitals": _dirs()["b0"]}, tmp_path / "pub", "tiny",
                           measured=measured, lock_check=verified)
    manifest = json.loads((out / "modular.json").read_text())
    assert manifest["lock_verified"] is True and manifest["lock_held_out"] == measured["lock_held_out"]
    assert "**Warning: not locked on the held-out test split**" in (out / "README.md").read_text()


# --- one writer at a time, full disks, the pair replaced together ----------------------------------------------------
def _tree(folder) -> dict:
    """Every file and folder under ``folder`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _hashes(out, keys) -> tuple:
    """The locked hash the published folder's manifest and its keys folder's manifest name (None: no folder)."""
    return tuple(json.loads((f / "modular.json").read_text())["locked_hash"] if f.is_dir() else None
                 for f in (out, keys))


DEAD_PID = 2**22 + 7  # above Linux's largest pid: never a running process


def test_a_folder_another_command_writes_is_refused_and_a_gone_writers_lock_taken_over(tmp_path, tok, caplog):
    """Two publishes to one folder: the second is refused in one line naming the folder and the holder, with nothing
    written (without --overwrite both used to finish, one silently replacing the other); so is an unlock into a
    folder being written. A lock left by a process that is gone is taken over with a log line."""
    import logging
    import socket

    from modular.locking import folder_lock

    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    before = _tree(tmp_path)
    for held in (out, keys):
        with folder_lock(held):
            with pytest.raises(ModularError) as err:
                publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), out, "tiny", overwrite=True)
            line = str(err.value)
            assert "\n" not in line and str(held) in line and f"pid {os.getpid()}" in line
        assert _tree(tmp_path) == before
    with folder_lock(tmp_path / "unlocked"):
        with pytest.raises(ModularError, match=f"unlocked is being written by another command .pid {os.getpid()}"):
            unlock_folder(out, keys / "b0.key.safetensors", tmp_path / "unlocked")
    assert _tree(tmp_path) == before
    stale = {"pid": DEAD_PID, "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00"}
    (tmp_path / ".pub2.lock").write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING, logger="modular"):
        publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub2", "tiny")
    assert f"took over the lock of pid {DEAD_PID}" in caplog.text
    assert (tmp_path / "pub2" / "modular.json").is_file() and not (tmp_path / ".pub2.lock").exists()


def _full_disk_after(monkeypatch, cls, nbytes=10):
    """``cls.save_pretrained`` writes a few bytes and fails as a full disk does."""
    import errno

    def full(self, folder, *args, **kwargs):
        (Path(folder) / "tokenizer.json").write_bytes(b"x" * nbytes)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cls, "save_pretrained", full)


def test_a_full_disk_is_one_line_naming_the_folder_and_the_space_needed(tmp_path, tok, monkeypatch, capsys):
    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    before = _tree(tmp_path)
    with monkeypatch.context() as m:
        _full_disk_after(m, type(tok))
        with pytest.raises(ModularError) as err:
            publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), tmp_path / "pub", "tiny", overwrite=True)
        assert str(err.value).startswith(f"no space left in {tmp_path} for pub (it needs about ")
        assert re.search(r"about [\d.]+ [kMG]?B, [\d.]+ [kMGT]?B free there\): .*nothing was written", str(err.value))
        assert _tree(tmp_path) == before  # the old pair, and nothing beside it
        from modular.app import cli

        assert cli.main(["unlock", "--model", str(out), "--key", str(keys / "b0.key.safetensors"), "--out",
                         str(tmp_path / "unlocked")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"error: no space left in {tmp_path} for unlocked (it needs about "), lines
    assert "Traceback" not in "\n".join(lines) and _tree(tmp_path) == before


@pytest.mark.parametrize("killed", [False, True])
def test_an_interrupted_overwrite_leaves_the_old_pair_or_the_new_pair(tmp_path, tok, monkeypatch, killed):
    """``publish --overwrite`` stopped at each rename it makes (an error, or a process killed there: nothing runs
    after it) leaves the published folder and its keys folder as the old pair or the new pair, by the manifests'
    locked hashes; once the next command (an unlock of the published folder with its key) has run, also after a
    kill, with nothing left beside them. It used to leave the old published folder beside the new keys, the old keys
    only in a hidden folder that the next write deleted."""
    pristine = tmp_path / "pristine"
    publish_model(make_tiny_model("llama"), tok, _dirs(), pristine / "pub", "tiny")
    place = tmp_path / "place"
    out, keys = place / "pub", place / "pub-keys"
    real = os.replace
    calls = []

    def counting(src, dst):
        calls.append(dst)
        return real(src, dst)

    shutil.copytree(pristine, place, symlinks=True)
    old = _hashes(out, keys)
    with monkeypatch.context() as m:
        m.setattr(os, "replace", counting)
        publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), out, "tiny", overwrite=True)
    new = _hashes(out, keys)
    assert old[0] == old[1] and new[0] == new[1] and old != new
    assert sum(Path(d) in (out, keys) for d in calls) == 2  # each folder moved in once (the rest: aside, journal)
    for at in range(1, len(calls) + 1):
        shutil.rmtree(place)
        shutil.copytree(pristine, place, symlinks=True)
        def failing(src, dst, seen=[], at=at):  # noqa: B006 - the calls of this attempt
            seen.append(dst)
            if len(seen) == at or (killed and len(seen) > at):
                raise KeyboardInterrupt if not killed else OSError("killed")
            return real(src, dst)

        with monkeypatch.context() as m:
            m.setattr(os, "replace", failing)
            with pytest.raises((KeyboardInterrupt, OSError)):
                publish_model(make_tiny_model("llama", seed=1), tok, _dirs(), out, "tiny", overwrite=True)
        if not killed:
            assert _hashes(out, keys) in (old, new), at
        unlocked = unlock_folder(out, keys / "b0.key.safetensors", tmp_path / f"unlocked{at}")  # the next command
        assert _hashes(out, keys) in (old, new), at
        assert json.loads((unlocked / "modular.json").read_text())["locked_hash"] == _hashes(out, keys)[0]
        assert sorted(p.name for p in place.iterdir()) == ["pub", "pub-keys"], (at, sorted(place.iterdir()))


# --- a Hub-ready card, and uploads that never carry a key ------------------------------------------------------------
@pytest.mark.parametrize("alias, hub_id, licence", [("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                     "apache-2.0"), ("gemma3-270m", "google/gemma-3-270m", "gemma")])
def test_the_card_of_a_built_in_model_is_one_the_hub_reads(tmp_path, alias, hub_id, licence):
    """The front matter is huggingface_hub's own (ModelCard loads it back): the base model's hub id and licence,
    transformers, text generation, modular's tags; the body keeps what the card says (no network)."""
    from huggingface_hub import ModelCard

    from modular.publish import model_card

    row = lambda acc: {"behaviours": {"capitals": {"accuracy": acc}}, "retain_first_token_kl": 0.02,  # noqa: E731
                       "perplexity_ratio": 1.0}
    text = model_card(["capitals"], alias, {"states": {"base": row(0.5), "locked": row(0.0)}}, hardened=True,
                      lock_check={"verified": False, "detail": "not reached"})
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert (data["base_model"], data["license"]) == (hub_id, licence)
    assert (data["library_name"], data["pipeline_tag"], data["tags"]) == ("transformers", "text-generation",
                                                                          ["modular", "locked-behaviour"])
    assert card.text.lstrip().startswith(f"# Locked model (base: {alias})")
    assert "**Warning: the lock was not verified.**" in card.text and "| capitals | not verified |" in card.text
    assert "`capitals.key.safetensors`" in card.text and "## Measured (held-out test split)" in card.text
    assert "| locked | 0.000 | 0.0200 | 1.000 |" in card.text


def test_the_card_names_key_files_never_a_path_and_a_local_bases_hub_model(tmp_path, tok):
    """Published from a local folder whose config names its hub model: the card's base_model is that hub id, its
    license the folder's card's; neither the keys folder's path nor the base's appears in any file of the folder."""
    from huggingface_hub import ModelCard

    from tests.conftest import save_tiny_folder

    base = save_tiny_folder(tmp_path / "models" / "my-base")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "someone/tiny-base"}))
    (base / "README.md").write_text("---\nlicense: mit\n---\n\nThe base.\n")
    keys_dir = tmp_path / "secret place" / "keys"
    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(2), tmp_path / "pub", str(base), keys_out=keys_dir)
    assert keys == keys_dir and sorted(p.name for p in keys.iterdir()) == ["b0.key.safetensors", "b1.key.safetensors",
                                                                           "modular.json"]
    card = ModelCard.load(out / "README.md")
    assert (card.data.base_model, card.data.license) == ("someone/tiny-base", "mit")
    assert "`b0.key.safetensors`" in card.text and "`b1.key.safetensors`" in card.text
    assert "# Locked model (base: my-base)" in card.text
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in {str(keys_dir), str(keys_dir.resolve()), str(tmp_path), str(tmp_path.resolve())}:
                assert secret.encode() not in data, (path.name, secret)


class _Hub:
    """A stand-in for huggingface_hub.HfApi (no network): the calls made, each as (name, args, kwargs)."""

    def __init__(self):
        self.calls = []
        self.instances = 0

    def __call__(self, *args, **kwargs):  # HfApi(...)
        self.instances += 1
        return self

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))

    def upload_folder(self, *args, **kwargs):
        self.calls.append(("upload_folder", args, kwargs))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"})()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    fake = _Hub()
    monkeypatch.setattr(huggingface_hub, "HfApi", fake)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    return fake


def test_push_uploads_the_published_folder_to_the_repo(tmp_path, tok, hub):
    from modular.publish import push_folder

    out, _ = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    url = push_folder(out, "user/locked-tiny", private=True)
    assert url == "https://huggingface.co/user/locked-tiny/commit/abc"
    (create, c_args, c_kw), (upload, _, u_kw) = hub.calls
    assert create == "create_repo" and c_args == ("user/locked-tiny",)
    assert c_kw["exist_ok"] is True and c_kw["private"] is True
    assert upload == "upload_folder" and u_kw["repo_id"] == "user/locked-tiny" and Path(u_kw["folder_path"]) == out
    assert not list(tmp_path.glob(".*.lock"))  # the folder's lock, held while it uploads, is released


def test_a_folder_holding_a_key_is_refused_with_nothing_uploaded(tmp_path, tok, hub):
    """A key file in the folder, by its name or renamed (modular's key marker in its header), and the keys folder
    itself: one line, before the hub is called at all."""
    from modular import ModularError
    from modular.keys import is_key_file
    from modular.publish import push_folder

    out, keys = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    assert not any(is_key_file(p) for p in out.rglob("*") if p.is_file())
    key = keys / "b0.key.safetensors"
    shutil.copy(key, out / "b0.key.safetensors")
    with pytest.raises(ModularError, match=r"holds the key file b0\.key\.safetensors; keys are never uploaded") as err:
        push_folder(out, "user/name")
    assert "\n" not in str(err.value)
    (out / "b0.key.safetensors").unlink()
    (out / "extra").mkdir()
    shutil.copy(key, out / "extra" / "weights.bin")  # renamed: still a key
    with pytest.raises(ModularError, match=r"holds the key file extra/weights\.bin"):
        push_folder(out, "user/name")
    with pytest.raises(ModularError, match="holds the key file b0.key.safetensors"):
        push_folder(keys, "user/name")
    assert hub.calls == [] and hub.instances == 0


def test_push_without_a_token_is_huggingface_hubs_error_in_one_line(tmp_path, tok, hub, monkeypatch):
    from huggingface_hub.utils import _headers

    from modular import ModularError
    from modular.publish import push_folder

    out, _ = publish_model(make_tiny_model("llama"), tok, _dirs(), tmp_path / "pub", "tiny")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(_headers, "get_token", lambda: None)  # no token saved by `hf auth login` either
    with pytest.raises(ModularError, match="cannot upload to the Hugging Face hub: Token is required") as err:
        push_folder(out, "user/name")
    assert "\n" not in str(err.value)
    with pytest.raises(ModularError, match="is not a hub repo id"):
        push_folder(out, "not a repo")
    assert hub.calls == [] and hub.instances == 0
