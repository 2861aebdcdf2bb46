"""The offline capability tasks shipped for lm-evaluation-harness: their data files are what the generators make,
every item has one right answer among four, and each task's YAML names its file."""

import json

import yaml

from modular.data.capability import CATEGORIES, TASK_DATA, task_data_text, task_folder


def test_the_shipped_files_are_what_the_generators_make():
    """After a change to the generators: write_task_data() writes them again."""
    for name, file in TASK_DATA.items():
        assert (task_folder() / file).read_text() == task_data_text(name), name


def test_every_item_has_one_right_answer_among_four():
    category_of = {w: c for c, words in CATEGORIES.items() for w in words}
    assert len(category_of) == sum(map(len, CATEGORIES.values()))  # no word in two categories
    for name, file in TASK_DATA.items():
        items = [json.loads(line) for line in (task_folder() / file).read_text().splitlines()]
        assert 100 <= len(items) <= 200
        for item in items:
            choices = item["choices"]
            assert len(set(choices)) == 4
            if name == "modular_categories":
                right = [c for c in choices if c == category_of[item["word"]]]
            else:
                right = [w for w in choices if category_of[w] == item["category"]]
            assert right == [choices[item["answer"]]], item
        assert {i["answer"] for i in items} == {0, 1, 2, 3}


def test_each_task_yaml_names_its_data_file():
    for name, file in TASK_DATA.items():
        (path,) = [p for p in task_folder().glob("*.yaml") if yaml.safe_load(p.read_text())["task"] == name]
        config = yaml.safe_load(path.read_text())
        assert config["dataset_path"] == "json" and config["dataset_kwargs"]["data_files"] == {"test": file}
        assert config["output_type"] == "multiple_choice"
        assert [m["metric"] for m in config["metric_list"]][0] == "acc"
