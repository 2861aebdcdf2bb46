import torch
from torch.utils.data import DataLoader

from modular.gating.loaders import PassSeededSampler, ResumableLoader, loader_states_fit


def _loader(n=10, batch_size=3):
    data = list(range(n))
    return ResumableLoader(data, sampler=PassSeededSampler(data), batch_size=batch_size, drop_last=True)


def _flat(batches):
    return [int(i) for b in batches for i in b]


def test_an_uninterrupted_loader_draws_what_a_shuffled_dataloader_draws():
    torch.manual_seed(3)
    plain = [_flat(DataLoader(list(range(10)), batch_size=3, shuffle=True, drop_last=True)) for _ in range(3)]
    after_plain = torch.rand(1)
    torch.manual_seed(3)
    loader = _loader()
    ours = [_flat(loader) for _ in range(3)]
    assert ours == plain and len({tuple(p) for p in ours}) == 3  # a new order every pass
    assert torch.equal(torch.rand(1), after_plain)  # the global random state is used as much, no more


def test_a_loader_resumed_mid_pass_gives_the_rest_of_that_pass():
    torch.manual_seed(0)
    loader = _loader()
    it = iter(loader)
    seen = [next(it), next(it)]
    state = loader.state_dict()
    assert state["yielded"] == 2
    rest = list(it)
    torch.manual_seed(99)  # another process: another global random state
    resumed = _loader()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert _flat(again) == _flat(rest)
    assert sorted(_flat(seen + again)) == sorted(_flat(seen + rest)) and len(set(_flat(seen + again))) == 9
    assert resumed.state_dict() == {"yielded": 3, "pass_seed": state["pass_seed"], "items": 10}
    # the pass after it is a new order (and the state says the pass just begun)
    nxt = list(resumed)
    assert _flat(nxt) != _flat(seen + again) and resumed.state_dict()["pass_seed"] != state["pass_seed"]


def test_a_state_saved_at_a_pass_end_or_start_begins_a_new_pass():
    for taken in (0, 3):
        torch.manual_seed(0)
        loader = _loader()
        it = iter(loader)
        for _ in range(taken):
            next(it)
        resumed = _loader()
        resumed.load_state_dict(loader.state_dict())
        assert len(list(resumed)) == 3  # a whole pass, nothing skipped
        assert resumed.state_dict()["yielded"] == 3


def test_loader_states_fit_only_loaders_over_the_same_data():
    states = [_loader(10).state_dict(), _loader(7).state_dict()]
    assert loader_states_fit(states, [10, 7])
    assert not loader_states_fit(states, [10, 8]) and not loader_states_fit(states, [10]) \
        and not loader_states_fit(states, [10, 7, 4])
    assert not loader_states_fit([{"yielded": 1, "pass_seed": 5}], [10])  # a state that names no size
