from modular.merge.plots import _label_offsets, gain_scatter


def test_labels_of_coinciding_points_are_stacked():
    offsets = _label_offsets([1.0, 1.0, 1.0, 0.2], [0.0, 0.0, 0.001, 0.5])
    assert sorted(offsets[:3]) == [0.0, 11.0, 22.0]  # three points in one spot: three label rows
    assert offsets[3] == 0.0  # a lone point keeps its label beside it


def test_gain_scatter_writes_a_png(tmp_path):
    pairs = [{"label": f"p{i}", "similarity": {"cka": 1.0}, "gain": {"gain": 0.0, "ci95": [-0.1, 0.1]}}
             for i in range(3)]
    corr = {"pearson": {"r": None, "ci95": None}, "spearman": {"r": None, "ci95": None}, "n": 3}
    path = gain_scatter(tmp_path / "g.png", pairs, corr, metric="cka")
    assert path.stat().st_size > 0
