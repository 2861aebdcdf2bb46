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
