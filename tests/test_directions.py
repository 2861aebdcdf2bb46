"""Direction files a user hands in (strategy ``file``, ``avoid_directions``): read and checked, or refused in one line."""

import pytest
import torch
from safetensors.torch import save_file

from modular import ModularError
from modular.directions import load_avoided_directions, load_direction_file

D = 8


def test_a_direction_file_is_read_normalised_in_either_format(tmp_path):
    v = torch.arange(1.0, D + 1)
    save_file({"direction": v}, str(tmp_path / "d.safetensors"))
    torch.save(v.reshape(2, D // 2), tmp_path / "d.pt")  # any shape with the model's width in entries
    for name in ("d.safetensors", "d.pt"):
        torch.testing.assert_close(load_direction_file(tmp_path / name, D), v / v.norm())
    with pytest.raises(ModularError, match=r"d.pt: direction has 8 entries, the model's width is 4"):
        load_direction_file(tmp_path / "d.pt", 4)


def test_a_run_folder_gives_every_direction_to_avoid(tmp_path):
    save_file({"a": torch.ones(D), "b": -torch.ones(D)}, str(tmp_path / "directions.safetensors"))
    got = load_avoided_directions([tmp_path], D)
    assert got.shape == (2, D) and torch.allclose(got.norm(dim=1), torch.ones(2))
    assert load_avoided_directions([], D) is None


@pytest.mark.parametrize("name, content, message", [
    ("d.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{", r"d.safetensors is not a readable safetensors file \("),
    ("d.pt", b"PK\x03\x04 cut short", r"d.pt is not a readable tensor file \("),
    ("missing.pt", None, "direction file not found"),
])
def test_a_damaged_or_missing_direction_file_is_one_line(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ModularError, match=message) as err:
        load_direction_file(tmp_path / name, D)
    assert "\n" not in str(err.value)


def test_a_direction_file_holding_something_else_is_refused(tmp_path):
    save_file({"weight": torch.ones(D)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModularError, match=r"holds no tensor named 'direction' \(found \['weight'\]\)"):
        load_direction_file(tmp_path / "w.safetensors", D)
    torch.save({"direction": torch.ones(D)}, tmp_path / "dict.pt")
    with pytest.raises(ModularError, match="holds a dict, not a direction tensor"):
        load_direction_file(tmp_path / "dict.pt", D)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "directions.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModularError, match=r"run/directions.safetensors is not a readable safetensors file"):
        load_avoided_directions([tmp_path / "run"], D)


def _longest_input(model) -> list[int]:
    """The longest input every forward of ``model`` saw, appended to the list returned."""
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return seen


def test_residual_reads_keep_the_end_of_a_prompt_longer_than_the_model_or_the_limit():
    """A prompt of thousands of tokens is read cut (issue 80.5: the steering path read a 30,001-token prompt whole
    and asked for 18 GB): to ``max_length`` where given, else to the model's positions (GPT-2's 128 here)."""
    from modular.directions import last_position_states, residual_covariance
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    model, tok = make_tiny_model("gpt2"), make_tiny_tokenizer()
    seen = _longest_input(model)
    long = " and" * 3000 + " of the"
    whole = last_position_states(model, tok, [long, "a b"], [False, True])  # past 128 positions GPT-2 fails
    assert max(seen) == 128 and whole.shape[0] == 2
    seen.clear()
    cut = last_position_states(model, tok, [long], [False], max_length=16)
    assert max(seen) == 16
    torch.testing.assert_close(cut, last_position_states(model, tok, [" and" * 14 + " of the"], [False]))  # its end
    seen.clear()
    residual_covariance(model, tok, [long, "a b"], [False, True], max_length=16)
    assert max(seen) == 16
