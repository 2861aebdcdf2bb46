#!/usr/bin/env python
"""Train a gated model: ``python train.py fit --config configs/gate_capitals_smollm2.yaml`` is
``modular train fit --config ...``.

A thin shim over the ``modular`` command (:mod:`modular.app.cli`, its ``train`` subcommand: a LightningCLI over
the gated module and its data); ``python train.py fit --help`` documents every option. A killed run resumes from
``last.ckpt`` in its run folder when started again with the same command (``--ckpt_path null`` starts afresh).
"""

import sys

from modular.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
