#!/usr/bin/env python
"""Train a gated model: ``python train.py fit --config configs/gate_capitals_smollm2.yaml``.

A thin shim over :mod:`modular.train_cli` (a LightningCLI over the gated module and its data);
``python train.py fit --help`` documents every option. A killed run resumes from ``last.ckpt`` in its run
folder when started again with the same command (``--ckpt_path null`` starts afresh).
"""

import sys

from modular.train_cli import main

if __name__ == "__main__":
    sys.exit(main())
