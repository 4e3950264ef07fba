#!/usr/bin/env python
"""GPT/Llama pretraining with megatron_lite. Launch with torchrun; flags follow Megatron-LM (--help)."""

import sys

from megatron_lite.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
